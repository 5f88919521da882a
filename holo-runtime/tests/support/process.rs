//! Child processes of the end-to-end tests (servers, engines' own commands): output into a log file,
//! bounded waits on what they do, killed when dropped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A child process whose stdout and stderr go to `log`; killed when dropped.
pub struct Process {
    pub child: Child,
    pub log: PathBuf,
}

impl Process {
    pub fn spawn(command: &mut Command, log: PathBuf) -> Process {
        let file = std::fs::File::create(&log).unwrap();
        let child = command
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Process { child, log }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its exit status and output, waiting at most `limit`.
    pub fn finish(&mut self, limit: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, self.output());
            }
            assert!(
                Instant::now() < deadline,
                "{} did not finish within {limit:?}:\n{}",
                self.log.display(),
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits at most `limit` for a connection to `port` on 127.0.0.1 to be accepted, failing early
    /// (with its output) when the process exits first.
    pub fn wait_accepting(&mut self, port: u16, limit: Duration) {
        let deadline = Instant::now() + limit;
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "{} exited ({status}) before accepting on port {port}:\n{}",
                    self.log.display(),
                    self.output()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not accept on port {port} within {limit:?}:\n{}",
                self.log.display(),
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nothing listens on (the OS's pick, released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
