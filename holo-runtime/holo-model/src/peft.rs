//! Which weights a LoRA adapter wraps, by PEFT 0.21's rules: [`LoraConfig`] (`target_modules`,
//! `target_parameters`, `rank_pattern`, `alpha_pattern`), the target modules as a list of names or a
//! regular expression ([`Targets`]), the patterns matched as PEFT's `get_pattern_key` matches them
//! ([`Pattern`]), `"all-linear"`, and the conversion PEFT applies to the mixtures transformers 5 fused
//! ([`LoraConfig::resolved`], after [`LoraConfig::named`] for a regular expression).
//!
//! The conversion is PEFT's `_convert_peft_config_moe`: on a family whose experts transformers 5 stacks
//! into parameters (`qwen3_moe`, by transformers' `qwen2_moe` conversion pattern), the expert and router
//! names of transformers 4's modules become target parameters: `gate_proj` with `up_proj` the stack
//! `gate_up_proj`, at twice the rank and twice alpha (one adapter of rank `2r` in place of two of rank
//! `r`, the same scale), `down_proj` the stack `down_proj`, and `gate` the router's `gate.weight`.
//! `"all-linear"` names every projection there and all of those. A mixture's dense layers
//! (Qwen3-MoE's `mlp_only_layers`) then keep no MLP adapter, as under PEFT. gpt-oss's experts were
//! never modules, and PEFT converts nothing for it: its `"all-linear"` is the attention alone.
//!
//! On such a mixture PEFT first turns a regular expression into the last dotted parts of the names it
//! matches (`_resolve_string_target_modules`): `model\.layers\.0\.self_attn\.q_proj` becomes `q_proj`,
//! every layer's, and an expert projection's transformers-4 name (`….mlp.experts.gate_proj`) counts as
//! matched where the pattern matches it beside a stack that holds it. [`LoraConfig::named`] does the same.

use crate::config::Arch;
pub use holo_core::peft::{Pattern, Targets, ALL_LINEAR};

/// Which projections get adapters, and their size.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    /// PEFT's `target_modules`: projection names (`q_proj`, …; a fused projection's parts name it),
    /// matched as PEFT matches a list (the module's full name, or a dotted suffix of it); or a regular
    /// expression the module's full name must match; or `"all-linear"`, every projection but the
    /// output head's.
    pub targets: Targets,
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
            targets: Targets::names(&["q_proj", "k_proj", "v_proj", "o_proj"]),
            seed: 0,
            dropout: 0.0,
            parameters: Vec::new(),
            rank_pattern: Pattern::default(),
            alpha_pattern: Pattern::default(),
        }
    }
}

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
        self.targets.all_linear()
    }

    /// On a mixture transformers 5 fused (`arch`), a regular expression as the names PEFT turns it
    /// into (see the module's documentation): the last dotted part of each of the model's `modules`
    /// (PEFT's names of its projections and routers) and `parameters` (of its expert stacks,
    /// `model.layers.0.mlp.experts.gate_up_proj`) the expression matches, and the transformers-4 names
    /// of the projections a stack holds where it matches them. Anything else, and an expression that
    /// matches nothing (which PEFT then refuses as not found), as it is.
    pub fn named(&self, arch: Arch, modules: &[String], parameters: &[String]) -> LoraConfig {
        let regex = match &self.targets {
            Targets::Regex(_) if arch == Arch::Qwen3Moe && !self.all_linear() => &self.targets,
            _ => return self.clone(),
        };
        let mut names: Vec<String> = Vec::new();
        let mut add = |name: &str| {
            if !names.iter().any(|known| known == name) {
                names.push(name.to_string());
            }
        };
        for key in modules.iter().chain(parameters) {
            if regex.matches(key) {
                add(key.rsplit('.').next().unwrap_or(key));
            }
        }
        for (old, new) in MIXTURE_MODULES {
            let mut probed = parameters.iter().filter_map(|key| {
                let (container, leaf) = key.rsplit_once('.')?;
                (leaf == new).then(|| format!("{container}.{old}"))
            });
            if probed.any(|key| regex.matches(&key)) {
                add(old);
            }
        }
        if names.is_empty() {
            return self.clone();
        }
        LoraConfig {
            targets: Targets::Names(names),
            ..self.clone()
        }
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
    /// again changes nothing. On such a mixture a regular expression is turned into names first
    /// ([`LoraConfig::named`]); elsewhere it stays as it is.
    pub fn resolved(&self, arch: Arch, projections: &[String]) -> Result<LoraConfig, String> {
        let mut resolved = self.clone();
        let fused = arch == Arch::Qwen3Moe;
        if self.all_linear() {
            let mut names = projections.to_vec();
            if fused {
                for (module, _) in MIXTURE_MODULES {
                    if !names.iter().any(|target| target == module) {
                        names.push(module.to_string());
                    }
                }
            }
            resolved.targets = Targets::Names(names);
        }
        if !fused {
            return Ok(resolved);
        }
        // A regular expression still here named nothing of the model's (LoraConfig::named): it
        // converts nothing, and matches nothing.
        let Targets::Names(names) = &resolved.targets else {
            return Ok(resolved);
        };
        let mut modules = Vec::new();
        let mut fused_parts = Vec::new();
        for target in names {
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
        resolved.targets = Targets::Names(modules);
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
            targets: Targets::names(&["all-linear"]),
            ..LoraConfig::default()
        };
        let resolved = lora.resolved(Arch::Qwen3Moe, &attention).unwrap();
        assert_eq!(resolved.targets, Targets::Names(attention.clone()));
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
        assert_eq!(
            (gpt_oss.targets, gpt_oss.parameters),
            (Targets::Names(attention), vec![])
        );

        let half = LoraConfig {
            targets: Targets::names(&["q_proj", "mlp.gate_proj"]),
            ..lora
        };
        let error = half.resolved(Arch::Qwen3Moe, &[]).unwrap_err();
        assert!(
            error.contains("gate_proj without also targeting up_proj"),
            "{error}"
        );
    }

    /// PEFT's `_resolve_string_target_modules`: a regular expression on a fused mixture becomes the
    /// last parts of what it matches, the stacks' transformers-4 projections among them.
    #[test]
    fn regular_expressions_on_fused_mixtures_become_names() {
        let modules = names(&[
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.mlp.gate",
            "model.layers.1.self_attn.q_proj",
        ]);
        let parameters = names(&[
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.gate.weight",
        ]);
        let lora = |regex: &str| LoraConfig {
            targets: Targets::Regex(regex.into()),
            ..LoraConfig::default()
        };
        let layer0 = lora(r"model\.layers\.0\.(self_attn\.q_proj|mlp\.experts\.(gate|up)_proj)");
        let named = layer0.named(Arch::Qwen3Moe, &modules, &parameters);
        assert_eq!(
            named.targets,
            Targets::names(&["q_proj", "gate_proj", "up_proj"])
        );
        let resolved = named.resolved(Arch::Qwen3Moe, &[]).unwrap();
        assert_eq!(resolved.targets, Targets::names(&["q_proj"]));
        assert_eq!(resolved.parameters, names(&["gate_up_proj"]));
        // Elsewhere, and where it matches nothing, the expression stays.
        assert_eq!(layer0.named(Arch::Qwen3, &modules, &parameters), layer0);
        let nothing = lora(r".*\.nothing");
        assert_eq!(
            nothing.named(Arch::Qwen3Moe, &modules, &parameters),
            nothing
        );
        assert_eq!(nothing.resolved(Arch::Qwen3Moe, &[]).unwrap(), nothing);
    }

    #[test]
    fn all_linear_as_a_string_is_all_linear() {
        let lora = LoraConfig {
            targets: Targets::Regex("all-linear".into()),
            ..LoraConfig::default()
        };
        let projections = names(&["q_proj", "v_proj"]);
        let resolved = lora.resolved(Arch::Qwen3, &projections).unwrap();
        assert_eq!(resolved.targets, Targets::Names(projections));
    }
}
