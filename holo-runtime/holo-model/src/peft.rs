//! Which weights a LoRA adapter wraps, by PEFT 0.21's rules: [`LoraConfig`] (`target_modules`,
//! `target_parameters`, `rank_pattern`, `alpha_pattern`), the patterns matched as PEFT's
//! `get_pattern_key` matches them ([`Pattern`]), `"all-linear"`, and the conversion PEFT applies to
//! the mixtures transformers 5 fused ([`LoraConfig::resolved`]).
//!
//! The conversion is PEFT's `_convert_peft_config_moe`: on a family whose experts transformers 5 stacks
//! into parameters (`qwen3_moe`, by transformers' `qwen2_moe` conversion pattern), the expert and router
//! names of transformers 4's modules become target parameters: `gate_proj` with `up_proj` the stack
//! `gate_up_proj`, at twice the rank and twice alpha (one adapter of rank `2r` in place of two of rank
//! `r`, the same scale), `down_proj` the stack `down_proj`, and `gate` the router's `gate.weight`.
//! `"all-linear"` names every projection there and all of those. A mixture's dense layers
//! (Qwen3-MoE's `mlp_only_layers`) then keep no MLP adapter, as under PEFT. gpt-oss's experts were
//! never modules, and PEFT converts nothing for it: its `"all-linear"` is the attention alone.

use crate::config::Arch;
pub use holo_core::peft::Pattern;

/// Which projections get adapters, and their size.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    /// PEFT's `target_modules` as a list: projection names (`q_proj`, …; a fused projection's parts
    /// name it), matched as PEFT matches a list (the module's full name, or a dotted suffix of it), or
    /// `["all-linear"]`, every projection but the output head's.
    pub targets: Vec<String>,
    pub seed: u64,
    /// Dropout on the adapters' input in training passes (see [`crate::model::Dropout`]); 0 for none.
    pub dropout: f64,
    /// PEFT's `target_parameters`: the expert stacks (`mlp.experts.gate_up_proj`,
    /// `mlp.experts.down_proj`; see [`crate::model::ExpertStack::named`]) and a router's weight
    /// (`mlp.gate.weight`, gpt-oss's `mlp.router.weight`); mixture-of-experts models only.
    pub parameters: Vec<String>,
    /// PEFT's `rank_pattern`: the rank of the adapters whose name a key matches, in place of `rank`.
    pub rank_pattern: Pattern<usize>,
    /// PEFT's `alpha_pattern`: the same for `alpha`.
    pub alpha_pattern: Pattern<f64>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj"]
                .map(String::from)
                .to_vec(),
            seed: 0,
            dropout: 0.0,
            parameters: Vec::new(),
            rank_pattern: Pattern::default(),
            alpha_pattern: Pattern::default(),
        }
    }
}

/// PEFT's shorthand for every linear layer but the output head.
pub const ALL_LINEAR: &str = "all-linear";

/// transformers 4's module names of a fused mixture's experts and router, and what transformers 5 holds
/// in their place (PEFT's `_MOE_TARGET_MODULE_MAPPING["qwen2_moe"]`), in PEFT's order of trying them.
const MIXTURE_MODULES: [(&str, &str); 4] = [
    ("gate", "gate.weight"),
    ("gate_proj", "gate_up_proj"),
    ("up_proj", "gate_up_proj"),
    ("down_proj", "down_proj"),
];

impl LoraConfig {
    /// Whether the targets are PEFT's `"all-linear"` (in any case, as PEFT compares it).
    pub fn all_linear(&self) -> bool {
        matches!(self.targets.as_slice(), [only] if only.eq_ignore_ascii_case(ALL_LINEAR))
    }

    /// The adapter's rank and alpha at `name`, PEFT's key of the adapted module
    /// (`model.layers.0.self_attn.q_proj`) or parameter (`model.layers.0.mlp.experts.gate_up_proj`):
    /// the patterns' where a key matches, `rank` and `alpha` otherwise.
    pub fn size_at(&self, name: &str) -> Result<(usize, f64), String> {
        Ok((
            self.rank_pattern.find(name)?.unwrap_or(self.rank),
            self.alpha_pattern.find(name)?.unwrap_or(self.alpha),
        ))
    }

    /// The configuration PEFT adapts an `arch` model with: `"all-linear"` as the names of the model's
    /// `projections` (each adaptable projection's short name), and on a mixture transformers 5 fused,
    /// the expert and router module names turned into target parameters (see the module's
    /// documentation). What PEFT writes to `adapter_config.json` is this configuration; resolving it
    /// again changes nothing.
    pub fn resolved(&self, arch: Arch, projections: &[String]) -> Result<LoraConfig, String> {
        let mut resolved = self.clone();
        let fused = arch == Arch::Qwen3Moe;
        if self.all_linear() {
            resolved.targets = projections.to_vec();
            if fused {
                for (module, _) in MIXTURE_MODULES {
                    if !resolved.targets.iter().any(|target| target == module) {
                        resolved.targets.push(module.to_string());
                    }
                }
            }
        }
        if !fused {
            return Ok(resolved);
        }
        let mut modules = Vec::new();
        let mut fused_parts = Vec::new();
        for target in &resolved.targets {
            let mapped = MIXTURE_MODULES
                .iter()
                .find(|(module, _)| target == module || target.ends_with(&format!(".{module}")));
            match mapped {
                Some(&(module, parameter)) => {
                    if !resolved.parameters.iter().any(|p| p == parameter) {
                        resolved.parameters.push(parameter.to_string());
                    }
                    if parameter == "gate_up_proj" && !fused_parts.contains(&module) {
                        fused_parts.push(module);
                    }
                }
                None if !modules.contains(target) => modules.push(target.clone()),
                None => {}
            }
        }
        match fused_parts.as_slice() {
            [] => {}
            [one] => {
                let other = if *one == "gate_proj" {
                    "up_proj"
                } else {
                    "gate_proj"
                };
                return Err(format!(
                    "cannot convert the LoRA target {one} without also targeting {other}: transformers \
                     5 fuses them into the experts' gate_up_proj (PEFT refuses it too)"
                ));
            }
            _ => {
                // One adapter of rank 2r in place of two of rank r, at the same scale.
                let key = r".*\.gate_up_proj";
                resolved.rank_pattern.insert(key, 2 * self.rank);
                resolved.alpha_pattern.insert(key, 2.0 * self.alpha);
            }
        }
        resolved.targets = modules;
        Ok(resolved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|name| name.to_string()).collect()
    }

    #[test]
    fn fused_mixtures_convert_module_names_as_peft() {
        let attention = names(&["q_proj", "k_proj", "v_proj", "o_proj"]);
        let lora = LoraConfig {
            rank: 2,
            alpha: 3.0,
            targets: names(&["all-linear"]),
            ..LoraConfig::default()
        };
        let resolved = lora.resolved(Arch::Qwen3Moe, &attention).unwrap();
        assert_eq!(resolved.targets, attention);
        assert_eq!(
            resolved.parameters,
            names(&["gate.weight", "gate_up_proj", "down_proj"])
        );
        assert_eq!(
            resolved.size_at("model.layers.3.mlp.experts.gate_up_proj"),
            Ok((4, 6.0))
        );
        assert_eq!(
            resolved.size_at("model.layers.3.mlp.experts.down_proj"),
            Ok((2, 3.0))
        );
        assert_eq!(
            resolved.resolved(Arch::Qwen3Moe, &attention).unwrap(),
            resolved
        );
        // gpt-oss's experts were never modules: nothing to convert.
        let gpt_oss = lora.resolved(Arch::GptOss, &attention).unwrap();
        assert_eq!((gpt_oss.targets, gpt_oss.parameters), (attention, vec![]));

        let half = LoraConfig {
            targets: names(&["q_proj", "mlp.gate_proj"]),
            ..lora
        };
        let error = half.resolved(Arch::Qwen3Moe, &[]).unwrap_err();
        assert!(
            error.contains("gate_proj without also targeting up_proj"),
            "{error}"
        );
    }
}
