//! The sampler as training sees it: every request at the run's temperature, `top_p` and `top_k` (the
//! trainer's log-probabilities are those of that distribution, whatever a sampler tag says), its
//! `max_tokens` capped at `max_completion_length`, and a prompt that already fills the model's context
//! answered with an empty completion that ended for length (the Loom then ends the rollout as truncated).

use holo_core::machine::{Completion, Finish};
use holo_core::sampler::{Prompt, Request, SampleFuture, Sampler};

use super::config::GrpoConfig;

pub struct Training<'a> {
    pub inner: &'a dyn Sampler,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: u32,
    pub max_completion_length: usize,
    /// The model's context, when the sampler is a model whose context is known.
    pub context: Option<usize>,
}

impl<'a> Training<'a> {
    pub fn new(inner: &'a dyn Sampler, config: &GrpoConfig, context: Option<usize>) -> Self {
        Training {
            inner,
            temperature: config.temperature,
            top_p: config.top_p,
            top_k: config.top_k,
            max_completion_length: config.max_completion_length,
            context,
        }
    }

    fn prepared(&self, request: &Request) -> Option<Request> {
        if let (Some(context), Prompt::Tokens(ids)) = (self.context, &request.prompt) {
            if ids.len() >= context {
                return None;
            }
        }
        let mut request = request.clone();
        let cap = self.max_completion_length as u32;
        request.params.max_tokens = Some(request.params.max_tokens.map_or(cap, |n| n.min(cap)));
        request.params.temperature = Some(self.temperature);
        request.params.top_p = Some(self.top_p);
        request.params.top_k = Some(self.top_k);
        Some(request)
    }
}

impl Sampler for Training<'_> {
    fn sample<'b>(&'b self, batch: &'b [Request]) -> SampleFuture<'b> {
        let prepared: Vec<Option<Request>> = batch.iter().map(|r| self.prepared(r)).collect();
        let forwarded: Vec<Request> = prepared.iter().flatten().cloned().collect();
        Box::pin(async move {
            let mut answers = self.inner.sample(&forwarded).await.into_iter();
            prepared
                .iter()
                .map(|request| match request {
                    Some(_) => answers.next().unwrap_or_else(|| {
                        Err(holo_core::SamplerError::Malformed(
                            "the sampler returned fewer results than requests".into(),
                        ))
                    }),
                    None => Ok(Completion {
                        finish: Finish::Length,
                        ..Completion::default()
                    }),
                })
                .collect()
        })
    }
}
