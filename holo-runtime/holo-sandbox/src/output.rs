//! [`Capture`]: one output stream of a sandboxed program, read on its own thread, capped.

use std::io::{self, Read};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// One output stream, read on its own thread: the first `limit` bytes kept, the rest counted (so an
/// output bomb costs reading time, never memory).
pub struct Capture {
    state: Arc<Mutex<(Vec<u8>, usize)>>,
    done: mpsc::Receiver<()>,
}

impl Capture {
    pub fn start(stream: Option<impl Read + Send + 'static>, limit: usize) -> Self {
        let state = Arc::new(Mutex::new((Vec::new(), 0)));
        let (sender, done) = mpsc::channel();
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            if let Some(mut stream) = stream {
                let mut buffer = [0u8; 8192];
                loop {
                    match stream.read(&mut buffer) {
                        Ok(0) => break,
                        Ok(n) => {
                            let mut state = shared.lock().unwrap_or_else(|e| e.into_inner());
                            let room = limit.saturating_sub(state.0.len()).min(n);
                            state.0.extend_from_slice(&buffer[..room]);
                            state.1 += n - room;
                        }
                        Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            }
            let _ = sender.send(());
        });
        Capture { state, done }
    }

    /// What was read (kept bytes, dropped byte count). Waits at most `wait` for the stream to end:
    /// every writer is normally gone by now, and a writer that is not (a process that escaped a
    /// process-group kill, in the unsandboxed path) must not hold the caller forever.
    pub fn finish(self, wait: Duration) -> (Vec<u8>, usize) {
        let _ = self.done.recv_timeout(wait);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (std::mem::take(&mut state.0), state.1)
    }
}
