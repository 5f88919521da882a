//! How fast each rollout server samples, measured on the requests it answers, and which server a
//! request goes to by it: the one that would be done with it first, its latency estimate times its
//! requests outstanding plus one, as Finagle's and Linkerd's peak-EWMA balancers weigh servers, below
//! [`super::Servers::capacity`] as well as at it.
//!
//! **What is measured.** A request's duration says little by itself: it grows with the request's
//! length (rollouts of one generation spread 30× and more) and, on a server that batches, with the
//! other requests it runs beside. So each answered request is charged its share of the server: the
//! time it was outstanding there divided, moment by moment, by the requests outstanding there then
//! (the virtual time of a processor-sharing queue, [`Load::shared`]). For a server that decodes its
//! batch one token per request per step, a request's share is its tokens times the step time per
//! token of throughput, however many requests it ran beside; for one that answers one request at a
//! time it is the request's own time. The raw duration would count a batching server's batch twice:
//! once in each request's duration, again in the `outstanding + 1`.
//!
//! The estimate is time per token: exponentially weighted averages ([`WEIGHT`]) of the shares and of
//! the tokens generated, one over the other, so that a long rollout weighs as its length and a short
//! one does not read as slowness. Averaging each request's share per token instead counts a server's
//! time per request (its prompt, the network, a proxy) over a short request's few tokens: a server
//! slow per request then reads as fast on long rollouts and slow on short ones, by chance of which
//! it was sent. A request sent to a server is expected to be done after `(outstanding + 1) ×
//! estimate`, times the request's length, unknown beforehand and the same wherever it goes.
//!
//! Two parts of peak-EWMA are left out. A measurement above the estimate is not taken whole at once
//! (the "peak"): a server falling behind already shows in its count outstanding, and the last
//! requests of a generation, alone on a batching server, would each reset it to its unbatched speed.
//! And an estimate does not decay toward zero while its server is sent nothing: on a pool of one fast
//! and one slow server, the request that would re-measure the slow one holds up a synchronous step by
//! the slow one's time. A server measured slow is measured again when the others are loaded enough
//! to send it a request, or when it comes back to the pool ([`Load::forget`]).
//!
//! The times come from a [`Clock`], the system's or a test's, so what a test measures does not
//! depend on how fast the machine running it is.

use std::time::Instant;

/// Where the pool reads the time.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// The weight of a new measurement in a server's estimate: a quarter, so that a server's estimate
/// follows a change of its speed within one generation's requests (8 and more) while one odd
/// request moves it by a quarter of its oddness.
pub const WEIGHT: f64 = 0.25;

/// One server's requests in flight and the estimate of its speed.
#[derive(Debug)]
pub struct Load {
    outstanding: usize,
    /// Seconds of the server each request outstanding on it has had since it was built: the time
    /// any requests were outstanding, each moment divided by how many were. A request's share is
    /// this when it is answered less this when it was sent.
    shared: f64,
    /// When `outstanding` last changed (or the server was built).
    since: Instant,
    /// The answered requests' shares of the server in seconds and their tokens generated, both
    /// averaged with [`WEIGHT`]: none until a request was answered.
    answers: Option<Answers>,
}

/// The weighted averages of a server's answered requests.
#[derive(Debug, Clone, Copy)]
struct Answers {
    seconds: f64,
    tokens: f64,
}

/// A request sent to a server: what [`Load::answered`] charges it from.
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    shared: f64,
}

impl Load {
    pub fn new(now: Instant) -> Self {
        Load {
            outstanding: 0,
            shared: 0.0,
            since: now,
            answers: None,
        }
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Seconds of the server per token generated, as measured so far.
    pub fn per_token(&self) -> Option<f64> {
        self.answers.map(|answers| answers.seconds / answers.tokens)
    }

    /// Brings `shared` up to `now`.
    fn advance(&mut self, now: Instant) {
        if self.outstanding > 0 {
            let elapsed = now.saturating_duration_since(self.since).as_secs_f64();
            self.shared += elapsed / self.outstanding as f64;
        }
        self.since = self.since.max(now);
    }

    /// A request sent to the server at `now`.
    pub fn send(&mut self, now: Instant) -> Sent {
        self.advance(now);
        self.outstanding += 1;
        Sent {
            shared: self.shared,
        }
    }

    /// The request `sent` back at `now`: answered with `tokens` generated (`None`: it failed or was
    /// given up, and says nothing of the server's speed). Taken as at least one token, since even a
    /// request that generated none had its prompt read.
    pub fn answered(&mut self, sent: Sent, now: Instant, tokens: Option<usize>) {
        self.advance(now);
        self.outstanding -= 1;
        if let Some(tokens) = tokens {
            let seconds = self.shared - sent.shared;
            let tokens = tokens.max(1) as f64;
            self.answers = Some(match self.answers {
                Some(mean) => Answers {
                    seconds: mean.seconds + WEIGHT * (seconds - mean.seconds),
                    tokens: mean.tokens + WEIGHT * (tokens - mean.tokens),
                },
                None => Answers { seconds, tokens },
            });
        }
    }

    /// Forgets the estimate: the server left the pool, and may come back another (restarted,
    /// moved, under another load).
    pub fn forget(&mut self) {
        self.answers = None;
    }
}

/// Of `candidates` (server indices into `loads`, in the order ties are taken), the one with room
/// below `capacity` whose new request would be done first: `(outstanding + 1) × estimate`. A
/// server not measured yet with nothing outstanding is tried first (a new server, or one back in
/// the pool), so that it gets measured; with requests outstanding it counts the candidates' mean
/// estimate until its first answer, or, when none is measured (a run's first requests), the same
/// for every server: the fewest outstanding. Ties go to the first. `None` when every one is full.
pub fn quickest(
    loads: &[Load],
    candidates: impl Iterator<Item = usize> + Clone,
    capacity: usize,
) -> Option<usize> {
    let measured: Vec<f64> = candidates
        .clone()
        .filter_map(|index| loads[index].per_token())
        .collect();
    let mean = if measured.is_empty() {
        1.0
    } else {
        measured.iter().sum::<f64>() / measured.len() as f64
    };
    let finish = |index: usize| {
        let load = &loads[index];
        match load.per_token() {
            None if load.outstanding == 0 => 0.0,
            estimate => (load.outstanding + 1) as f64 * estimate.unwrap_or(mean),
        }
    };
    candidates
        .filter(|&index| loads[index].outstanding < capacity)
        .map(|index| (index, finish(index)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(start: Instant, seconds: f64) -> Instant {
        start + Duration::from_secs_f64(seconds)
    }

    /// A server measured at `per_token` seconds a token, with `outstanding` requests in flight.
    fn measured(start: Instant, per_token: Option<f64>, outstanding: usize) -> Load {
        let mut load = Load::new(start);
        if let Some(per_token) = per_token {
            let sent = load.send(start);
            load.answered(sent, at(start, per_token), Some(1));
        }
        for _ in 0..outstanding {
            load.send(at(start, 100.0));
        }
        load
    }

    #[test]
    fn a_request_is_charged_its_share_of_the_server_per_token() {
        // The first request alone for 1 s, then beside a second for 1 s (half of it its own): 1.5 s,
        // for 1 token. The second beside it for 1 s (0.5) and alone for 2 s: 2.5 s, for 5 tokens.
        let start = Instant::now();
        let mut load = Load::new(start);
        let first = load.send(start);
        let second = load.send(at(start, 1.0));
        load.answered(first, at(start, 2.0), Some(1));
        assert_eq!(load.per_token(), Some(1.5));
        assert_eq!(load.outstanding(), 1);
        load.answered(second, at(start, 4.0), Some(5));
        // Weighted 3 to 1 (WEIGHT): 1.75 s for 2 tokens. A mean of the shares per token would say
        // 1.25: the long request's 0.5 s a token weighed as much as the short one's 1.5.
        assert_eq!(load.per_token(), Some(1.75 / 2.0));
        assert_eq!(load.outstanding(), 0);
    }

    #[test]
    fn a_failed_request_and_an_idle_server_measure_nothing() {
        let start = Instant::now();
        let mut load = Load::new(start);
        let failed = load.send(at(start, 3.0));
        load.answered(failed, at(start, 4.0), None);
        assert_eq!(load.per_token(), None);
        // Idle from 4 s to 10 s: none of that is the next request's.
        let answered = load.send(at(start, 10.0));
        load.answered(answered, at(start, 12.0), Some(0));
        assert_eq!(load.per_token(), Some(2.0));
        load.forget();
        assert_eq!(load.per_token(), None);
    }

    #[test]
    fn a_request_goes_where_it_would_be_done_first() {
        let start = Instant::now();
        // Four times as fast: the fast server takes requests until it has three outstanding.
        let mut loads = vec![
            measured(start, Some(1.0), 0),
            measured(start, Some(0.25), 2),
        ];
        assert_eq!(quickest(&loads, [0, 1].into_iter(), 64), Some(1));
        loads[1].send(start);
        // 4 × 0.25 against 1 × 1.0: tied, the first in turn.
        assert_eq!(quickest(&loads, [0, 1].into_iter(), 64), Some(0));
        assert_eq!(quickest(&loads, [1, 0].into_iter(), 64), Some(1));
        // Full, the fast server takes nothing, however fast: the cap is a hard limit.
        assert_eq!(quickest(&loads, [1, 0].into_iter(), 3), Some(0));
        loads[0].send(start);
        assert_eq!(quickest(&loads, [0, 1].into_iter(), 1), None);
    }

    #[test]
    fn a_server_not_measured_yet_is_tried_first_then_weighed_as_the_mean() {
        let start = Instant::now();
        let loads = vec![measured(start, Some(0.1), 0), measured(start, None, 0)];
        assert_eq!(quickest(&loads, [0, 1].into_iter(), 64), Some(1));
        // Busy and unmeasured, it counts the mean of the others: 2 × 1.0 against 3 × 1.0.
        let loads = vec![
            measured(start, Some(1.0), 2),
            measured(start, None, 1),
            measured(start, Some(1.0), 2),
        ];
        assert_eq!(quickest(&loads, [0, 1, 2].into_iter(), 64), Some(1));
        assert_eq!(quickest(&loads, [0, 2].into_iter(), 64), Some(0));
    }

    #[test]
    fn unmeasured_servers_take_the_fewest_outstanding_ties_first_in_turn() {
        let start = Instant::now();
        let loads = vec![
            measured(start, None, 2),
            measured(start, None, 1),
            measured(start, None, 1),
        ];
        assert_eq!(quickest(&loads, [0, 1, 2].into_iter(), 64), Some(1));
        assert_eq!(quickest(&loads, [2, 0, 1].into_iter(), 64), Some(2));
    }
}
