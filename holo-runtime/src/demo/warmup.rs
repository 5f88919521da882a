//! The supervised warm-up: a few steps of SFT (the [SFT trainer](crate::train::sft)'s loss and optimizer
//! step) on token sequences built exactly as the environment's rollouts record them, each step's batch
//! drawn afresh from the teacher.

use crate::train::TrainingArguments;
use std::collections::BTreeMap;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::holophore::Holophore;
use crate::interpreter::{Holoware, Row};
use crate::machine::{Completion, Finish, Rollout, Step};
use crate::train::batch::Sequence;
use crate::train::run::Trainable;
use crate::train::sft::{loss, SftConfig, SftLossType};
use crate::Resources;

/// A reply recorded as the trainer records a rollout, with the rewards the environment gave it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub sequence: Sequence,
    /// Each reward component's value, by name.
    pub rewards: BTreeMap<String, f64>,
}

/// A rollout of `holoware` on `row` in which the model replies `reply` and ends its turn with
/// `end_of_turn`, recorded by a fork of `holophore`: the prompt ids are the ones a sampler is given,
/// and the trained positions are the reply's tokens and the end of turn. Fails unless the rollout asks
/// for exactly one sample in one trained context and its rewards are computed without errors.
pub fn sequence(
    holoware: &Arc<Holoware>,
    holophore: &Holophore,
    row: &Row,
    reply: &str,
    end_of_turn: u32,
) -> Result<Recorded, String> {
    let mut recorder = holophore.fork();
    let mut rollout = holoware
        .start_with(row, &Resources::default())
        .map_err(|error| error.to_string())?;
    let request = match rollout.step(&mut recorder).map_err(|e| e.to_string())? {
        Step::Sample(request) => request,
        Step::Done => return Err(format!("`{}` asks the model nothing", holoware.name())),
    };
    // What a sampler would be given; recorded as the sampler sees it.
    recorder.prompt_ids();
    let mut tokens = holophore
        .tokenizer()
        .encode(reply, false)
        .map_err(|error| format!("tokenizer: {error}"))?
        .get_ids()
        .to_vec();
    tokens.push(end_of_turn);
    let completion = Completion {
        text: reply.to_string(),
        logprobs: vec![0.0; tokens.len()],
        tokens,
        top_logprobs: Vec::new(),
        finish: Finish::EndOfTurn,
        routes: Vec::new(),
        weight_version: None,
        constraint: None,
    };
    rollout
        .resume(completion, &mut recorder)
        .map_err(|error| error.to_string())?;
    if let Step::Sample(again) = rollout.step(&mut recorder).map_err(|e| e.to_string())? {
        return Err(format!(
            "`{}` asks the model twice ({} and {}); the warm-up writes one reply",
            holoware.name(),
            request.location,
            again.location
        ));
    }
    if !recorder.errors().is_empty() {
        return Err(format!(
            "the reply {reply:?} fails in `{}`: {:?}",
            holoware.name(),
            recorder.errors()
        ));
    }
    let rewards = recorder
        .rewards()
        .iter()
        .map(|(name, value, _)| (name.clone(), *value))
        .collect();
    let contexts = recorder.finish();
    let trained: Vec<&crate::holophore::Context> = contexts
        .iter()
        .filter(|context| context.loss_mask().contains(&1))
        .collect();
    let [context] = trained.as_slice() else {
        return Err(format!(
            "`{}` trains {} contexts; the warm-up writes one",
            holoware.name(),
            trained.len()
        ));
    };
    let ids = context.ids();
    let trained: Vec<usize> = context
        .loss_mask()
        .iter()
        .enumerate()
        .filter(|&(position, &mask)| mask != 0 && position > 0)
        .map(|(position, _)| position)
        .collect();
    Ok(Recorded {
        sequence: Sequence {
            sampling_logprobs: vec![f32::NAN; trained.len()],
            ids,
            trained,
            routes: None,
            constraints: Default::default(),
        },
        rewards,
    })
}

/// How long and how fast the warm-up trains.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub steps: u64,
    /// Sequences per step.
    pub batch_size: usize,
    pub learning_rate: f64,
}

impl Budget {
    /// The SFT options of the warm-up: `steps` AdamW steps (TRL's defaults: no weight decay, gradients
    /// clipped to norm 1) at a learning rate decaying linearly to 0, every weight trained.
    pub fn config(&self, seed: u64) -> SftConfig {
        SftConfig {
            training: TrainingArguments {
                max_steps: self.steps as i64,
                per_device_train_batch_size: self.batch_size,
                learning_rate: self.learning_rate,
                seed,
                ..SftConfig::default().training
            },
            ..SftConfig::default()
        }
    }
}

/// `budget.steps` SFT steps of `trained` (built for [`Budget::config`]) on the sequences `batch` draws
/// for each step from the generator seeded by `seed`: minus the mean log-probability of their trained
/// tokens, one optimizer step each. `on_step` sees each step's loss. Returns the mean loss of the last
/// tenth of the steps.
pub fn train(
    trained: &mut Trainable,
    budget: &Budget,
    seed: u64,
    mut batch: impl FnMut(&mut ChaCha8Rng) -> Result<Vec<Sequence>, String>,
    mut on_step: impl FnMut(u64, f64),
) -> Result<f64, String> {
    let fail = |error: candle_core::Error| format!("the warm-up failed: {error}");
    let config = budget.config(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut recent = Vec::new();
    for step in 0..budget.steps {
        let sequences = batch(&mut rng)?;
        if sequences.is_empty() {
            return Err("the warm-up has nothing to train on".into());
        }
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let tokens = sequences.iter().map(|s| s.trained.len()).sum();
        let micro = loss::micro_batch(
            &trained.model,
            &sequences,
            tokens,
            SftLossType::Nll,
            Default::default(),
        )
        .map_err(fail)?;
        let mut grads = trained.no_grads();
        trained.accumulate(&mut grads, &micro.grads).map_err(fail)?;
        trained
            .step(&grads, &config, step, budget.steps, 1.0)
            .map_err(fail)?;
        on_step(step + 1, micro.loss);
        if step >= budget.steps - budget.steps.div_ceil(10) {
            recent.push(micro.loss);
        }
    }
    Ok(recent.iter().sum::<f64>() / recent.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatTemplate;
    use crate::demo::data::Problem;
    use crate::holotypes;
    use crate::local::init::build_tokenizer;
    use crate::loom::{Loom, LoomConfig, RolloutRecord};
    use crate::train::batch;
    use crate::Scripted;

    #[test]
    fn a_warm_up_sequence_is_the_rollout_the_trainer_records_for_the_right_reply() {
        let tokenizer = build_tokenizer().unwrap();
        let end_of_turn = tokenizer.token_to_id("<|im_end|>").unwrap();
        let holophore =
            Holophore::new(Arc::new(tokenizer), Arc::new(ChatTemplate::chatml())).unwrap();
        let holoware = Arc::new(
            Holoware::load(
                super::super::HOLOWARE_NAME,
                super::super::HOLOWARE.as_bytes(),
                Arc::new(holotypes::registry()),
            )
            .unwrap(),
        );
        let problem = Problem { a: 47, b: 8 };
        let warm = sequence(
            &holoware,
            &holophore,
            &problem.row(),
            &problem.reply(),
            end_of_turn,
        )
        .unwrap();
        let (warm, rewards) = (warm.sequence, warm.rewards);

        // The trainer's path: the Loom records the rollout in token space, a sampler answers the
        // prompt ids it is given with the reply's tokens and the end of turn.
        let reply = format!("{}<|im_end|>", problem.reply());
        let sampler = Scripted::new([reply]).tokenized(&holophore);
        let loom = Loom::interpreted(
            Arc::clone(&holoware),
            Resources::default(),
            LoomConfig {
                timing: false,
                ..LoomConfig::default()
            },
        )
        .with_holophore(holophore.fork());
        let mut records: Vec<RolloutRecord> = Vec::new();
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(loom.run(&[(0, problem.row())], &sampler, &mut records))
            .unwrap();
        let record = records.pop().unwrap();
        assert_eq!(record.rewards["math_answer"], 1.0);
        assert_eq!(record.rewards, rewards);
        let recorded = batch::sequences(&record);
        assert_eq!(recorded.len(), 1);
        assert_eq!(recorded[0].ids, warm.ids);
        assert_eq!(recorded[0].trained, warm.trained);
        let trained: Vec<u32> = warm.trained.iter().map(|&p| warm.ids[p]).collect();
        assert_eq!(
            trained.last(),
            Some(&end_of_turn),
            "the end of turn is trained"
        );
    }

    #[test]
    fn a_wrong_reply_is_recorded_with_the_rewards_it_earns() {
        let tokenizer = build_tokenizer().unwrap();
        let holophore =
            Holophore::new(Arc::new(tokenizer), Arc::new(ChatTemplate::chatml())).unwrap();
        let holoware = Arc::new(
            Holoware::load(
                "x.hol",
                super::super::HOLOWARE.as_bytes(),
                Arc::new(holotypes::registry()),
            )
            .unwrap(),
        );
        let row = Problem { a: 47, b: 8 }.row();
        let earned = |reply: &str| {
            let recorded = sequence(&holoware, &holophore, &row, reply, 511).unwrap();
            (recorded.rewards["math_answer"], recorded.rewards["format"])
        };
        assert_eq!(earned("<answer>55</answer>"), (1.0, 1.0));
        assert_eq!(earned("<answer>45</answer>"), (0.0, 1.0));
        assert_eq!(earned("54"), (0.0, 0.0));
    }
}
