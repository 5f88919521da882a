//! A context's own chat template arguments (`<|+++ enable_thinking=false|>`): that context is rendered
//! with the run's arguments and its own over them, whole (as templates without frames are: the frames
//! were derived with the run's arguments), and the next context goes back to the run's rendering.

use std::sync::Arc;

use minijinja::Value;

use super::tools::template_value;
use super::{Holophore, Rendering};
use crate::machine::TemplateArg;

impl Rendering {
    /// The same rendering (tools included) with `variables` as the template arguments.
    fn with_variables(&self, variables: &std::collections::BTreeMap<String, Value>) -> Rendering {
        let with = |options: &crate::chat::RenderOptions| crate::chat::RenderOptions {
            variables: variables.clone(),
            ..options.clone()
        };
        self.changed(with, self.header.clone())
    }
}

impl Holophore {
    /// [`crate::Recorder::template_arguments`]: the context just begun renders with `arguments` over
    /// the run's.
    pub(super) fn apply_template_arguments(
        &mut self,
        arguments: &[(&str, TemplateArg<'_>)],
    ) -> Result<(), String> {
        let open = self.contexts.last().filter(|context| !context.closed);
        if open.is_some_and(|context| !context.sampled_ids().is_empty()) {
            return Err("template arguments must come before the context's first turn".into());
        }
        // The assistant header of the run's frames stays the header: the arguments change what the
        // template writes around turns (a generation prompt with an empty think block), not which
        // tokens open an assistant turn.
        let header = self.assistant_header();
        let (base, _) = self
            .restore
            .get_or_insert_with(|| (Arc::clone(&self.rendering), self.frames.clone()));
        let mut variables = base.generation.variables.clone();
        for &(name, argument) in arguments {
            variables.insert(name.to_string(), template_value(&argument.json()));
        }
        let mut rendering = base.with_variables(&variables);
        if rendering.header.is_empty() {
            rendering.header = header;
        }
        self.rendering = Arc::new(rendering);
        self.frames = None;
        if let Some(context) = self.contexts.last_mut().filter(|context| !context.closed) {
            context.fragments.clear();
            context.pending_text.clear();
            context.rendered.clear();
        }
        Ok(())
    }

    /// At a new context: back to the run's rendering and frames after a context with arguments of
    /// its own.
    pub(super) fn restore_rendering(&mut self) {
        if let Some((rendering, frames)) = self.restore.take() {
            self.rendering = rendering;
            self.frames = frames;
        }
    }
}
