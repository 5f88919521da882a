//! Bounded staleness (`max_off_policy_steps = k`): generations drawn on a thread of their own while the
//! trainer trains on earlier ones.
//!
//! When the loop takes up generation `g`, generation `g + k` is started with a sampler of the weights
//! as they are then ([`Backend::snapshot`]: an in-process copy, or the rollout servers), so the weights
//! that sample a generation are at most `k` generations behind those that train on it, by construction:
//! nothing is discarded for being too old, and a long rollout delays only the step that needs it. The
//! thread draws the generations one after another, each whole (its rows, its `G` rollouts each, dynamic
//! sampling's refills), from a data stream of its own that runs ahead of the trainer's; each generation
//! carries where it left the stream ([`Drawn::position`]), which the trainer's state takes when it
//! takes the generation up.
//!
//! Exact resume: a checkpoint waits for the generations being drawn and keeps them all
//! ([`TrainerState::ahead`]), with the stream's position after the newest; a resumed run takes them up
//! first and starts the next ones where the stream stood, so it trains on the same rollouts as the run
//! that was not interrupted (they were sampled by weights the checkpoint no longer holds, so they
//! could not be drawn again).

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;

use indicatif::ProgressBar;

use super::backend::Backend;
use super::generation::Drawer;
use crate::error::TrainError;
use crate::state::{Drawn, TrainerState};
use holo_core::loom::RolloutSource;
use holo_core::sampler::Sampler;

/// A generation to draw: the sampler of the weights it is drawn with, and the step that will train on
/// it (for the messages of its rollouts' failures).
struct Launch {
    sampler: Arc<dyn Sampler>,
    context: Option<usize>,
    step: u64,
}

/// The generations drawn ahead of the trainer's steps, and the thread that draws them.
pub(super) struct Ahead {
    depth: u64,
    launches: Option<mpsc::Sender<Launch>>,
    results: mpsc::Receiver<Result<Drawn, TrainError>>,
    /// Launched and not yet received.
    drawing: u64,
    /// Drawn and not yet taken up, oldest first.
    ready: VecDeque<Drawn>,
    /// The latest launch's sampler and the weight version it samples, which the next launch shares
    /// while the weights have not changed (at the start, `k + 1` launches of the same weights).
    latest: Option<(u64, Arc<dyn Sampler>, Option<usize>)>,
}

impl Ahead {
    /// Starts the thread that draws with `drawer`, from where `state`'s stream stands, taking up first
    /// the generations `state` kept ([`TrainerState::ahead`]). The thread ends when the returned value
    /// is dropped and its current generation is drawn.
    pub(super) fn start<'scope, S: RolloutSource>(
        scope: &'scope std::thread::Scope<'scope, '_>,
        drawer: Drawer<'scope, S>,
        state: &mut TrainerState,
        progress: &ProgressBar,
    ) -> std::io::Result<Ahead> {
        let depth = drawer.config.max_off_policy_steps;
        let (launches, launched) = mpsc::channel::<Launch>();
        let (done, results) = mpsc::channel();
        // The thread's own copy of the stream's position: it draws ahead of the trainer's.
        let mut stream_state = TrainerState::default();
        stream_state.set_position(state.position());
        let progress = progress.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("holo-rollouts-ahead".into())
            .spawn_scoped(scope, move || {
                for launch in launched {
                    let drawn = drawer.draw(
                        &runtime,
                        launch.sampler.as_ref(),
                        launch.context,
                        &mut stream_state,
                        launch.step,
                        &progress,
                    );
                    let failed = drawn.is_err();
                    if done.send(drawn).is_err() || failed {
                        break;
                    }
                }
            })?;
        Ok(Ahead {
            depth,
            launches: Some(launches),
            results,
            drawing: 0,
            ready: std::mem::take(&mut state.ahead).into(),
            latest: None,
        })
    }

    /// The next generation to train on: first the generations the bound now allows are
    /// started with `backend`'s weights as they are (one in the steady state; `k + 1` at the start),
    /// then the oldest is taken, waiting for it if it is still being drawn. `generate_every` and
    /// `accumulation` (micro-batches per generation and per optimizer step) say which step each new
    /// generation will be trained at.
    pub(super) fn next(
        &mut self,
        backend: &mut impl Backend,
        state: &TrainerState,
        generate_every: u64,
        accumulation: u64,
    ) -> Result<Drawn, TrainError> {
        while self.ready.len() as u64 + self.drawing < self.depth + 1 {
            let version = state.global_step;
            let (sampler, context) = match &self.latest {
                Some((latest, sampler, context)) if *latest == version => {
                    (Arc::clone(sampler), *context)
                }
                _ => {
                    let (sampler, context) = backend.snapshot(version)?;
                    self.latest = Some((version, Arc::clone(&sampler), context));
                    (sampler, context)
                }
            };
            let ahead = self.ready.len() as u64 + self.drawing;
            let step = (state.micro_step + ahead * generate_every) / accumulation + 1;
            let launch = Launch {
                sampler,
                context,
                step,
            };
            let sent = self
                .launches
                .as_ref()
                .is_some_and(|launches| launches.send(launch).is_ok());
            if !sent {
                // The thread stopped after a failed generation, whose error is waiting in `results`.
                break;
            }
            self.drawing += 1;
        }
        match self.ready.pop_front() {
            Some(drawn) => Ok(drawn),
            None => self.receive(),
        }
    }

    /// Waits for every generation being drawn, and returns a copy of `state` that a checkpoint keeps:
    /// with the drawn generations not yet taken up, and the stream where the newest left it.
    pub(super) fn settled(&mut self, state: &TrainerState) -> Result<TrainerState, TrainError> {
        while self.drawing > 0 {
            let drawn = self.receive()?;
            self.ready.push_back(drawn);
        }
        let mut kept = state.clone();
        if let Some(newest) = self.ready.back() {
            kept.set_position(newest.position.clone());
        }
        kept.ahead = self.ready.iter().cloned().collect();
        Ok(kept)
    }

    /// The oldest generation being drawn, once drawn. The thread's sampling has its deadlines (the
    /// sampler's and the Loom's); this wait ends with it, or with its error.
    fn receive(&mut self) -> Result<Drawn, TrainError> {
        let drawn = self.results.recv().map_err(|_| {
            TrainError::Rollouts(
                "the thread drawing rollouts ahead of the steps stopped without a result".into(),
            )
        })?;
        self.drawing -= 1;
        if drawn.is_err() {
            // Nothing more is launched: the run stops with this error.
            self.launches = None;
        }
        drawn
    }
}
