//! PEFT's adapter configuration as far as the trainers' options read it without a model: its
//! `target_modules` ([`Targets`]), `rank_pattern` and `alpha_pattern` ([`Pattern`]). holo-model resolves
//! a configuration against a model's modules (`holo_model::model::LoraConfig`); the options that carry
//! them (holo-train's) are read in builds without the model too.

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// PEFT's shorthand for every linear layer but the output head.
pub const ALL_LINEAR: &str = "all-linear";

/// PEFT's `target_modules`, in either of its forms. A list names modules: each name matches a module
/// whose PEFT name (`model.layers.0.self_attn.q_proj`) it is or ends with after a dot (`q_proj`,
/// `self_attn.q_proj`). One string is a regular expression the whole name must match (PEFT's
/// `re.fullmatch`: `.*\.(q_proj|v_proj)`, `model\.layers\.[01]\.self_attn\.q_proj`), except
/// `"all-linear"` in any case, PEFT's shorthand for every linear layer but the output head (also
/// taken as the list `["all-linear"]`). Read and written as PEFT writes it: a list, or a string.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Targets {
    Names(Vec<String>),
    Regex(String),
}

impl Targets {
    /// A list of names.
    pub fn names<S: AsRef<str>>(names: &[S]) -> Self {
        Targets::Names(names.iter().map(|name| name.as_ref().to_string()).collect())
    }

    /// Whether the targets are PEFT's `"all-linear"` (in any case, as PEFT compares it).
    pub fn all_linear(&self) -> bool {
        match self {
            Targets::Names(names) => {
                matches!(names.as_slice(), [only] if only.eq_ignore_ascii_case(ALL_LINEAR))
            }
            Targets::Regex(regex) => regex.eq_ignore_ascii_case(ALL_LINEAR),
        }
    }

    /// Whether the targets adapt the module PEFT names `key`: a name that is the key or a dotted suffix
    /// of it, or the regular expression matching the whole key (never, if it is not one: see
    /// [`Targets::check`]). `"all-linear"` is resolved against a model's modules before matching.
    pub fn matches(&self, key: &str) -> bool {
        match self {
            Targets::Names(names) => names
                .iter()
                .any(|name| key == name || key.ends_with(&format!(".{name}"))),
            Targets::Regex(regex) => whole_regex(regex).is_ok_and(|regex| regex.is_match(key)),
        }
    }

    /// An error for a regular expression this crate does not read (Python's look-arounds and
    /// back-references), naming it.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Targets::Regex(regex) if !self.all_linear() => whole_regex(regex).map(drop),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for Targets {
    /// As PEFT's configuration writes it: `["q_proj", "v_proj"]`, or the regular expression quoted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Targets::Names(names) => write!(f, "{names:?}"),
            Targets::Regex(regex) => write!(f, "{regex:?}"),
        }
    }
}

impl<'de> Deserialize<'de> for Targets {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either;
        impl<'de> Visitor<'de> for Either {
            type Value = Targets;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a list of module names, or a string (a regular expression, or \"all-linear\")",
                )
            }

            fn visit_str<E: serde::de::Error>(self, regex: &str) -> Result<Targets, E> {
                Ok(Targets::Regex(regex.to_string()))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Targets, A::Error> {
                let mut names = Vec::new();
                while let Some(name) = seq.next_element::<String>()? {
                    names.push(name);
                }
                Ok(Targets::Names(names))
            }
        }
        deserializer.deserialize_any(Either)
    }
}

/// `re.fullmatch`'s expression for `regex`: anchored at both ends.
fn whole_regex(regex: &str) -> Result<regex_automata::meta::Regex, String> {
    regex_automata::meta::Regex::new(&format!("^(?:{regex})$")).map_err(|error| {
        format!("the target modules {regex:?} are not a regular expression: {error}")
    })
}

/// PEFT's `rank_pattern` or `alpha_pattern`: keys (regular expressions) with their values, in order. A
/// key matches an adapter's name as PEFT's `get_pattern_key` matches it, `(.*\.)?(KEY)$` from the
/// name's start, so `q_proj` is every `…q_proj`, and `layers.0.self_attn.q_proj` layer 0's; the first
/// key in order that matches gives the value. Read and written as a map that keeps its order
/// (`adapter_config.json`'s; a TOML table's keys come sorted).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Pattern<T>(Vec<(String, T)>);

impl<T: Copy> Pattern<T> {
    /// The entries, in order.
    pub fn entries(&self) -> &[(String, T)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sets `key`'s value: in its place if it is there, last otherwise (as a Python dict).
    pub fn insert(&mut self, key: &str, value: T) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.0.push((key.to_string(), value)),
        }
    }

    /// The value of the first key that matches `name`.
    pub fn find(&self, name: &str) -> Result<Option<T>, String> {
        for (key, value) in &self.0 {
            if key_regex(key)?.is_match(name) {
                return Ok(Some(*value));
            }
        }
        Ok(None)
    }

    /// An error naming the first key that is no regular expression this crate reads (Python's
    /// look-arounds and back-references are not).
    pub fn check(&self) -> Result<(), String> {
        self.0
            .iter()
            .try_for_each(|(key, _)| key_regex(key).map(drop))
    }
}

impl<T> FromIterator<(String, T)> for Pattern<T> {
    fn from_iter<I: IntoIterator<Item = (String, T)>>(entries: I) -> Self {
        Pattern(entries.into_iter().collect())
    }
}

/// `get_pattern_key`'s expression for `key`, anchored at both ends.
fn key_regex(key: &str) -> Result<regex_automata::meta::Regex, String> {
    regex_automata::meta::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$"))
        .map_err(|error| format!("the pattern key {key:?} is not a regular expression: {error}"))
}

impl<T: Serialize> Serialize for Pattern<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Pattern<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Entries<T> {
            type Value = Pattern<T>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a table of patterns and their values")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, T>()? {
                    entries.push(entry);
                }
                Ok(Pattern(entries))
            }
        }
        deserializer.deserialize_map(Entries(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_as_peft_s_get_pattern_key() {
        let pattern: Pattern<usize> = [
            ("layers.0.self_attn.q_proj".to_string(), 8),
            ("q_proj".to_string(), 4),
            (r".*\.experts\..*".to_string(), 6),
        ]
        .into_iter()
        .collect();
        let find = |name: &str| pattern.find(name).unwrap();
        assert_eq!(find("model.layers.0.self_attn.q_proj"), Some(8));
        assert_eq!(find("model.layers.10.self_attn.q_proj"), Some(4));
        // A key matches whole dotted segments from the name's end, not any substring.
        assert_eq!(find("model.layers.1.self_attn.xq_proj"), None);
        assert_eq!(find("model.layers.1.self_attn.q_proj.extra"), None);
        assert_eq!(find("model.layers.1.mlp.experts.down_proj"), Some(6));
        let bad: Pattern<usize> = [("(?=q)".to_string(), 1)].into_iter().collect();
        assert!(bad.check().unwrap_err().contains("(?=q)"));
    }

    /// A list matches names and dotted suffixes; a string matches the whole name, as `re.fullmatch`.
    #[test]
    fn targets_match_as_peft_s_check_target_module_exists() {
        let key = "model.layers.1.self_attn.q_proj";
        let names = Targets::names(&["self_attn.q_proj"]);
        assert!(names.matches(key));
        assert!(!names.matches("model.layers.1.self_attn.xq_proj"));
        let regex = Targets::Regex(r"model\.layers\.[01]\.self_attn\.(q|k)_proj".into());
        assert!(regex.matches(key));
        assert!(!regex.matches("model.layers.2.self_attn.q_proj"));
        // Anchored at both ends, the alternation inside: `a|b` is not `^a|b$`.
        assert!(!Targets::Regex("q_proj".into()).matches(key));
        assert!(!Targets::Regex(r"model\..*|x".into()).matches("xmodel.a"));
        assert!(Targets::Regex(r".*\.q_proj|x".into()).matches(key));
        // As PEFT writes them: a string or a list, and "all-linear" either way.
        let read = |json: &str| serde_json::from_str::<Targets>(json).unwrap();
        assert_eq!(read(r#""all-linear""#).to_string(), r#""all-linear""#);
        assert!(read(r#""ALL-LINEAR""#).all_linear() && read(r#"["all-linear"]"#).all_linear());
        assert_eq!(
            serde_json::to_string(&regex).unwrap(),
            r#""model\\.layers\\.[01]\\.self_attn\\.(q|k)_proj""#
        );
        assert_eq!(
            read(r#"["q_proj","v_proj"]"#),
            Targets::names(&["q_proj", "v_proj"])
        );
        let error = serde_json::from_str::<Targets>("3")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("a list of module names, or a string"),
            "{error}"
        );
        let error = Targets::Regex("(?=q)_proj".into()).check().unwrap_err();
        assert!(
            error.contains(r#""(?=q)_proj" are not a regular expression"#),
            "{error}"
        );
    }
}
