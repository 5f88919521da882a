//! The futures every Tinker operation answers with: a request id now, its result later through
//! `POST /api/v1/retrieve_future`, which the SDK polls until it gets something other than `try_again`.
//!
//! A retrieval waits for the result up to [`Futures::poll`] (the hosted service long-polls too), then
//! answers `{"type": "try_again"}`, on which the SDK asks again; the worker thread that computes a result
//! wakes the waiting retrieval through a `watch` channel.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;

/// What an operation came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A JSON result (the SDK's pydantic response type).
    Json(Value),
    /// A protobuf result (`ForwardBackwardOutput`, `SampleResponse`).
    Proto(Vec<u8>),
    /// The operation failed: its message and the SDK's `RequestErrorCategory` (`user` for a request
    /// that cannot succeed, `server` for a failure here).
    Failed { error: String, category: Category },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    User,
    Server,
}

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::User => "user",
            Category::Server => "server",
        }
    }
}

/// Completes one future; dropping it unfulfilled fails the future (a worker that died).
pub struct Promise {
    sender: watch::Sender<Option<Outcome>>,
}

impl Promise {
    pub fn fulfil(self, outcome: Outcome) {
        self.sender.send_replace(Some(outcome));
    }
}

impl Drop for Promise {
    fn drop(&mut self) {
        self.sender.send_if_modified(|slot| {
            if slot.is_some() {
                return false;
            }
            *slot = Some(Outcome::Failed {
                error: "the server's worker stopped before finishing this request".into(),
                category: Category::Server,
            });
            true
        });
    }
}

/// What a retrieval finds.
#[derive(Debug, Clone, PartialEq)]
pub enum Retrieved {
    Unknown,
    Pending,
    Done(Outcome),
}

/// The futures kept, the most recent: results stay after retrieval, so that a retrieval whose answer was
/// lost can be repeated, but not for the server's whole life.
pub const KEPT: u64 = 16_384;

/// The [`KEPT`] most recent futures, by request id.
pub struct Futures {
    /// Request ids start with a prefix drawn at start, so that an id from before a restart is unknown
    /// rather than another request's.
    prefix: String,
    next: AtomicU64,
    slots: Mutex<HashMap<String, watch::Receiver<Option<Outcome>>>>,
    /// How long a retrieval waits for a result before answering `try_again`.
    pub poll: Duration,
}

/// A random 64-bit number from the standard library's per-process hash keys.
pub fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos()),
    );
    hasher.finish()
}

impl Futures {
    pub fn new(poll: Duration) -> Self {
        Futures {
            prefix: format!("{:08x}", random_u64() as u32),
            next: AtomicU64::new(0),
            slots: Mutex::new(HashMap::new()),
            poll,
        }
    }

    /// A new future: its request id, and the promise that completes it.
    pub fn create(&self) -> (String, Promise) {
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{number}", self.prefix);
        let (sender, receiver) = watch::channel(None);
        let mut slots = self.slots.lock().expect("not poisoned");
        if let Some(oldest) = number.checked_sub(KEPT) {
            slots.remove(&format!("{}-{oldest}", self.prefix));
        }
        slots.insert(id.clone(), receiver);
        (id, Promise { sender })
    }

    /// The outcome of `id`, waiting up to [`Futures::poll`] for it.
    pub async fn retrieve(&self, id: &str) -> Retrieved {
        let receiver = self.slots.lock().expect("not poisoned").get(id).cloned();
        let Some(mut receiver) = receiver else {
            return Retrieved::Unknown;
        };
        let waited = tokio::time::timeout(self.poll, receiver.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(outcome)) => Retrieved::Done(outcome.clone().expect("waited for Some")),
            // The sender is gone without a value: `Promise::drop` always sets one first.
            Ok(Err(_)) => Retrieved::Done(Outcome::Failed {
                error: "the request was dropped unanswered".into(),
                category: Category::Server,
            }),
            Err(_) => Retrieved::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_retrieval_says_try_again_until_the_result_is_there() {
        let futures = Futures::new(Duration::ZERO);
        let (id, promise) = futures.create();
        assert_eq!(futures.retrieve(&id).await, Retrieved::Pending);
        assert_eq!(futures.retrieve("nope").await, Retrieved::Unknown);
        promise.fulfil(Outcome::Json(Value::Null));
        assert_eq!(
            futures.retrieve(&id).await,
            Retrieved::Done(Outcome::Json(Value::Null))
        );
        // Kept: a retrieval whose answer was lost can be repeated.
        assert_eq!(
            futures.retrieve(&id).await,
            Retrieved::Done(Outcome::Json(Value::Null))
        );
        let (id, promise) = futures.create();
        drop(promise);
        assert!(matches!(
            futures.retrieve(&id).await,
            Retrieved::Done(Outcome::Failed {
                category: Category::Server,
                ..
            })
        ));
    }

    /// Only the most recent futures are kept.
    #[tokio::test]
    async fn the_oldest_futures_are_forgotten() {
        let futures = Futures::new(Duration::ZERO);
        let (first, promise) = futures.create();
        promise.fulfil(Outcome::Json(Value::Null));
        for _ in 1..KEPT {
            futures.create();
        }
        assert!(matches!(futures.retrieve(&first).await, Retrieved::Done(_)));
        futures.create();
        assert_eq!(futures.retrieve(&first).await, Retrieved::Unknown);
    }

    /// A retrieval that waits is woken by the result from another thread, well before its poll ends.
    #[tokio::test]
    async fn a_waiting_retrieval_is_woken_by_the_result() {
        let futures = Futures::new(Duration::from_secs(600));
        let (id, promise) = futures.create();
        let worker = std::thread::spawn(move || promise.fulfil(Outcome::Proto(vec![1])));
        assert_eq!(
            futures.retrieve(&id).await,
            Retrieved::Done(Outcome::Proto(vec![1]))
        );
        worker.join().unwrap();
    }
}
