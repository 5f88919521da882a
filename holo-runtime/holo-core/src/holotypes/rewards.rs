//! Reward holotypes (attractors). Each records one named reward component, with the weight given by
//! `weight=` (default 1), and a sentence of feedback saying why it has that value; `name=` renames the
//! component. A reward is scored when execution reaches the tag, so that later tags can read it (the
//! gate and the feedback of a retry: [`Retry`](super::Retry), [`Feedback`](super::Feedback)), and again
//! when the rollout ends: the value at the end counts, and a rollout that stopped before the tag (a
//! truncated sample) is scored too.
//!
//! The compared text comes from the variable `var=` (default `answer`): the content of its last
//! `<answer>...</answer>` when it has one (`tag=` picks another tag), else the whole text.

use crate::holotype::{AnswerCheck, Args, Cx, Enter, Holotype, HolotypeError};
use crate::holotypes::tools::last_tag;

/// The settings every reward holotype shares.
struct Component {
    name: String,
    weight: f64,
    variable: String,
    tag: String,
    /// Execution reached the tag.
    reached: bool,
}

impl Component {
    /// `holotype`'s shared arguments; `default_name` names its component when `name=` does not.
    fn new(args: &Args, holotype: &str, default_name: &str) -> Result<Self, HolotypeError> {
        args.no_positional(holotype)?;
        Ok(Component {
            name: args.name("name")?.unwrap_or(default_name).to_string(),
            weight: args.float("weight")?.unwrap_or(1.0),
            variable: args.name("var")?.unwrap_or("answer").to_string(),
            tag: args.name("tag")?.unwrap_or("answer").to_string(),
            reached: false,
        })
    }

    /// Whether to score when the rollout ends: a tag never reached whose variable was never bound (the
    /// turn it scores did not happen, as a retry its gate skipped) records nothing, so the component is
    /// missing rather than 0.
    fn scores_at_end(&self, cx: &Cx<'_>) -> bool {
        self.reached || cx.var(&self.variable).is_some()
    }

    fn record(&self, cx: &mut Cx<'_>, value: f64, feedback: &str) {
        cx.weighted_reward(&self.name, value, self.weight);
        cx.feedback(&self.name, feedback);
    }
}

/// `text` cut to at most 80 characters, for feedback that quotes the model.
fn quoted(text: &str) -> String {
    const LIMIT: usize = 80;
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// The content of the last `<tag>...</tag>` of `text`, or the whole text, trimmed.
pub fn answer_text<'t>(text: &'t str, tag: &str) -> &'t str {
    last_tag(text, tag).unwrap_or(text).trim()
}

/// What a comparison reads from a text without the answer tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Untagged {
    /// The whole text.
    Whole,
    /// The last number in the text ([`last_number`]).
    LastNumber,
}

/// The component [`ExactAnswer`] records unless `name=` renames it.
const EXACT_ANSWER: &str = "exact_answer";
/// The component [`MathAnswer`] records unless `name=` renames it.
const MATH_ANSWER: &str = "math_answer";

/// A reward that compares the answer with a column of the data row (`target=`, default `expected`).
struct Comparison {
    component: Component,
    target: String,
    untagged: Untagged,
}

impl Comparison {
    fn new(args: &Args, holotype: &str, default_name: &str) -> Result<Self, HolotypeError> {
        Comparison::pass(args)?;
        Ok(Comparison {
            component: Component::new(args, holotype, default_name)?,
            target: args.name("target")?.unwrap_or("expected").to_string(),
            untagged: Untagged::Whole,
        })
    }

    /// The column compared with, which the reward fails without.
    fn needs(args: &Args) -> Vec<String> {
        let target = args.name("target").ok().flatten().unwrap_or("expected");
        vec![target.to_string()]
    }

    /// The `pass=` mark: `true` or `false`.
    fn pass(args: &Args) -> Result<Option<bool>, HolotypeError> {
        match args.text("pass")? {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(other) => Err(HolotypeError::new(format!(
                "argument `pass` must be `true` or `false`, found `{other}`"
            ))),
        }
    }

    /// The component an answer check with `args` records, and its `pass=` mark.
    fn answer_check(args: &Args, default_name: &str) -> Option<AnswerCheck> {
        Some(AnswerCheck {
            component: args
                .name("name")
                .ok()
                .flatten()
                .unwrap_or(default_name)
                .to_string(),
            pass: Comparison::pass(args).ok().flatten(),
        })
    }

    /// The answer in the variable: its last tag's content, or what `untagged` says of a text without one.
    fn answer<'c>(&self, cx: &'c Cx<'_>) -> Option<&'c str> {
        let text = cx.var(&self.component.variable)?;
        match self.untagged {
            Untagged::Whole => Some(answer_text(text, &self.component.tag)),
            Untagged::LastNumber => match last_tag(text, &self.component.tag) {
                Some(tagged) => Some(tagged.trim()),
                None => last_number(text),
            },
        }
    }

    /// Records 1 when `equal(answer, expected)`, else 0, with feedback that names the answer (never the
    /// expected one).
    fn record(&self, cx: &mut Cx<'_>, equal: fn(&str, &str) -> bool) -> Result<(), HolotypeError> {
        let expected = cx
            .var(&self.target)
            .ok_or_else(|| {
                HolotypeError::new(format!(
                    "the data row has no `{}` column to compare with",
                    self.target
                ))
            })?
            .to_string();
        let answer = self.answer(cx).filter(|answer| !answer.is_empty());
        let correct = answer.is_some_and(|answer| equal(answer, &expected));
        let feedback = match answer {
            None => format!(
                "There is no answer: give it inside <{tag}>...</{tag}> tags.",
                tag = self.component.tag
            ),
            Some(answer) if correct => format!("The answer {} is correct.", quoted(answer)),
            Some(answer) => format!("The answer {} is incorrect.", quoted(answer)),
        };
        self.component
            .record(cx, if correct { 1.0 } else { 0.0 }, &feedback);
        Ok(())
    }
}

/// Whether two texts are equal once surrounding whitespace and runs of spaces are ignored.
fn texts_equal(a: &str, b: &str) -> bool {
    a.split_whitespace().eq(b.split_whitespace())
}

/// 1 when the answer equals the data row's `target=` column (default `expected`), ignoring surrounding
/// whitespace and runs of spaces; else 0.
pub struct ExactAnswer(Comparison);

impl Holotype for ExactAnswer {
    const PARAMS: &'static [&'static str] = &["var", "target", "tag", "pass", "weight", "name"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        Comparison::new(args, "ExactAnswer", EXACT_ANSWER).map(ExactAnswer)
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        self.0.component.reached = true;
        self.0.record(cx, texts_equal)?;
        Ok(Enter::Run)
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        if !self.0.component.scores_at_end(cx) {
            return Ok(());
        }
        self.0.record(cx, texts_equal)
    }

    fn needs(args: &Args) -> Vec<String> {
        Comparison::needs(args)
    }

    fn answer_check(args: &Args) -> Option<AnswerCheck> {
        Comparison::answer_check(args, EXACT_ANSWER)
    }
}

/// 1 when the answer and the `target=` column are the same number: integers, decimals, fractions
/// (`3/4`, `\frac{3}{4}`), `\boxed{...}`, `$`, thousands separators (`1,234`) and a trailing `%` are
/// understood, and `0.75`, `3/4` and `\boxed{\frac{3}{4}}` are equal. Text that is not a number is
/// compared as [`ExactAnswer`] compares it.
///
/// `untagged=last_number` compares the last number of a reply that has no answer tag (as lm-eval's
/// "flexible extract" reads GSM8K answers), instead of the whole reply (`untagged=whole`, the default):
/// a small model that writes `9 x 6 = 54 shells.` is then rewarded for the number before it learns the tags.
pub struct MathAnswer(Comparison);

impl Holotype for MathAnswer {
    const PARAMS: &'static [&'static str] =
        &["var", "target", "tag", "untagged", "pass", "weight", "name"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let mut comparison = Comparison::new(args, "MathAnswer", MATH_ANSWER)?;
        comparison.untagged = match args.text("untagged")? {
            None | Some("whole") => Untagged::Whole,
            Some("last_number") => Untagged::LastNumber,
            Some(other) => {
                return Err(HolotypeError::new(format!(
                    "argument `untagged` must be `whole` or `last_number`, found `{other}`"
                )))
            }
        };
        Ok(MathAnswer(comparison))
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        self.0.component.reached = true;
        self.0.record(cx, numbers_equal)?;
        Ok(Enter::Run)
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        if !self.0.component.scores_at_end(cx) {
            return Ok(());
        }
        self.0.record(cx, numbers_equal)
    }

    fn needs(args: &Args) -> Vec<String> {
        Comparison::needs(args)
    }

    fn answer_check(args: &Args) -> Option<AnswerCheck> {
        Comparison::answer_check(args, MATH_ANSWER)
    }
}

/// Whether two answers are the same number (see [`MathAnswer`]), or the same text when either is not a
/// number.
pub fn numbers_equal(a: &str, b: &str) -> bool {
    match (Rational::parse(a), Rational::parse(b)) {
        (Some(a), Some(b)) => a == b,
        _ => texts_equal(&strip_math(a), &strip_math(b)),
    }
}

/// The last number of `text` that [`MathAnswer`] understands, read word by word from the end: words are
/// split at whitespace and `=`, and lose trailing `,;:!?.` then, unless that makes a number already (as in
/// `\boxed{18}`), surrounding brackets, quotes and `*`: `9 x 6 = 54 shells.` gives `54`, `(1,024)!` gives
/// `1,024` and `**3/4**` gives `3/4`.
pub fn last_number(text: &str) -> Option<&str> {
    text.rsplit(|c: char| c.is_whitespace() || c == '=')
        .find_map(|word| {
            // `\boxed{18}.` keeps its braces; `(18)` and `**18**` lose theirs.
            let sentence = word.trim_end_matches(|c: char| ",;:!?.".contains(c));
            let bare = sentence
                .trim_start_matches(|c: char| "([{\"'*`".contains(c))
                .trim_end_matches(|c: char| ")]}\"'*`,;:!?.".contains(c));
            [sentence, bare]
                .into_iter()
                .find(|candidate| Rational::parse(candidate).is_some())
        })
}

/// An exact rational number, in lowest terms with a positive denominator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rational {
    numerator: i128,
    denominator: i128,
}

impl Rational {
    fn new(numerator: i128, denominator: i128) -> Option<Self> {
        if denominator == 0 {
            return None;
        }
        let divisor = gcd(numerator.unsigned_abs(), denominator.unsigned_abs()).max(1) as i128;
        let sign = if denominator < 0 { -1 } else { 1 };
        Some(Rational {
            numerator: sign * numerator / divisor,
            denominator: sign * denominator / divisor,
        })
    }

    fn parse(text: &str) -> Option<Self> {
        let text = strip_math(text);
        let text = text.trim();
        if let Some(percent) = text.strip_suffix('%') {
            let value = Self::parse(percent)?;
            return Self::new(value.numerator, value.denominator.checked_mul(100)?);
        }
        if let Some(inner) = text
            .strip_prefix("\\frac{")
            .or_else(|| text.strip_prefix("\\dfrac{"))
        {
            let (numerator, rest) = inner.split_once("}{")?;
            let denominator = rest.strip_suffix('}')?;
            return Self::divide(Self::parse(numerator)?, Self::parse(denominator)?);
        }
        if let Some((numerator, denominator)) = text.split_once('/') {
            return Self::divide(Self::parse(numerator)?, Self::parse(denominator)?);
        }
        Self::decimal(text)
    }

    fn divide(a: Rational, b: Rational) -> Option<Self> {
        Self::new(
            a.numerator.checked_mul(b.denominator)?,
            a.denominator.checked_mul(b.numerator)?,
        )
    }

    /// `-1,234.50` → -123450/100, with thousands separators only between groups of three digits.
    fn decimal(text: &str) -> Option<Self> {
        let (negative, digits) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text.strip_prefix('+').unwrap_or(text)),
        };
        let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
        let whole = if whole.contains(',') {
            let groups: Vec<&str> = whole.split(',').collect();
            let well_formed = !groups[0].is_empty()
                && groups[0].len() <= 3
                && groups[1..].iter().all(|group| group.len() == 3);
            if !well_formed {
                return None;
            }
            groups.concat()
        } else {
            whole.to_string()
        };
        if whole.is_empty() && fraction.is_empty() {
            return None;
        }
        let all_digits = |part: &str| part.chars().all(|c| c.is_ascii_digit());
        if !all_digits(&whole) || !all_digits(fraction) || fraction.len() > 30 {
            return None;
        }
        let digits = format!("{whole}{fraction}");
        let numerator: i128 = digits.parse().ok()?;
        let denominator = 10i128.checked_pow(fraction.len() as u32)?;
        Self::new(if negative { -numerator } else { numerator }, denominator)
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Removes `\boxed{...}`, `$` signs, a final full stop and surrounding whitespace.
fn strip_math(text: &str) -> String {
    let clean = |text: &str| {
        text.trim()
            .trim_end_matches('.')
            .trim()
            .trim_matches('$')
            .trim()
            .to_string()
    };
    let mut text = clean(text);
    while let Some(inner) = text
        .strip_prefix("\\boxed{")
        .and_then(|rest| rest.strip_suffix('}'))
    {
        text = clean(inner);
    }
    text
}

/// The fraction of the XML tags in `tags=` (space-separated, default `answer`) that the variable `var=`
/// holds as `<tag>...</tag>`.
pub struct FormatReward {
    component: Component,
    tags: Vec<String>,
}

impl Holotype for FormatReward {
    const PARAMS: &'static [&'static str] = &["var", "tags", "weight", "name"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let tags: Vec<String> = args
            .text("tags")?
            .unwrap_or("answer")
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if tags.is_empty() {
            return Err(HolotypeError::new("tags= names no tag"));
        }
        Ok(FormatReward {
            component: Component::new(args, "FormatReward", "format")?,
            tags,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        self.component.reached = true;
        self.score(cx);
        Ok(Enter::Run)
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        if self.component.scores_at_end(cx) {
            self.score(cx);
        }
        Ok(())
    }
}

impl FormatReward {
    fn score(&self, cx: &mut Cx<'_>) {
        let text = cx.var(&self.component.variable).unwrap_or_default();
        let missing: Vec<String> = self
            .tags
            .iter()
            .filter(|tag| {
                let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
                !text
                    .find(&open)
                    .is_some_and(|start| text[start + open.len()..].contains(&close))
            })
            .map(|tag| format!("<{tag}>...</{tag}>"))
            .collect();
        let value = (self.tags.len() - missing.len()) as f64 / self.tags.len() as f64;
        let feedback = if missing.is_empty() {
            "The reply has the tags it needs.".to_string()
        } else {
            format!("The reply lacks {}.", missing.join(" and "))
        };
        self.component.record(cx, value, &feedback);
    }
}

/// A penalty for text in `var=` longer than `max=` characters (default 1000): 0 up to the limit, then
/// minus the excess as a fraction of the limit, down to -1.
pub struct LengthPenalty {
    component: Component,
    max: u32,
}

impl Holotype for LengthPenalty {
    const PARAMS: &'static [&'static str] = &["var", "max", "weight", "name"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let max = args.count("max")?.unwrap_or(1000);
        if max == 0 {
            return Err(HolotypeError::new("max must be at least 1"));
        }
        Ok(LengthPenalty {
            component: Component::new(args, "LengthPenalty", "length_penalty")?,
            max,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        self.component.reached = true;
        self.score(cx);
        Ok(Enter::Run)
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        if self.component.scores_at_end(cx) {
            self.score(cx);
        }
        Ok(())
    }
}

impl LengthPenalty {
    fn score(&self, cx: &mut Cx<'_>) {
        let length = cx
            .var(&self.component.variable)
            .unwrap_or_default()
            .chars()
            .count();
        let max = f64::from(self.max);
        let value = -((length as f64 - max).max(0.0) / max).min(1.0);
        let feedback = if value < 0.0 {
            format!("The reply is {length} characters long, over the limit of {max}.")
        } else {
            format!("The reply is {length} characters long, within the limit of {max}.")
        };
        self.component.record(cx, value, &feedback);
    }
}
