//! `holo serve` as a child process on a free port, serving a tiny random model (`holo init-model`), for
//! the tests that need an OpenAI-compatible policy.
#![cfg(feature = "cli")]

use std::time::Duration;

/// A tiny random model folder written by `holo init-model` into a fresh temporary folder named after
/// `name`.
pub fn tiny_model(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("holo-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let init = std::process::Command::new(env!("CARGO_BIN_EXE_holo"))
        .args(["init-model", "--preset", "tiny", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "holo init-model failed:\n{}",
        String::from_utf8_lossy(&init.stderr)
    );
    dir
}

/// A `holo serve` child process: its base URL (from the line it prints) and its stderr, line by line;
/// killed on drop.
pub struct Served {
    pub child: std::process::Child,
    pub base: String,
    pub lines: std::sync::mpsc::Receiver<String>,
}

impl Served {
    pub fn start(command: &mut std::process::Command) -> Served {
        use std::io::BufRead;
        use std::process::Stdio;

        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        let mut served = Served {
            child,
            base: String::new(),
            lines,
        };
        let line = served.line_with("http://");
        let at = line.find("http://").unwrap();
        served.base = line[at..].split_whitespace().next().unwrap().to_string();
        served
    }

    /// The next stderr line that contains `text` (waiting at most a minute for it).
    pub fn line_with(&self, text: &str) -> String {
        let mut seen = String::new();
        loop {
            match self.lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) if line.contains(text) => return line,
                Ok(line) => {
                    seen.push_str(&line);
                    seen.push('\n');
                }
                Err(error) => panic!("holo serve wrote no line with {text:?} ({error}):\n{seen}"),
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
