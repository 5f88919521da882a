//! Code generation: [`crate::ir::Program`] → a Rust module (`proc_macro2::TokenStream`) holding a typed, sans-IO
//! state machine that implements `holo_runtime::Machine`.
//!
//! For a file `tool.hol` the module contains:
//! - `Input`: one field per input variable (`holo_runtime::Text`, or `Option` when every use has an
//!   alternative), deserializable from a data row;
//! - `Vars`: one `Option<String>` per sampler-bound variable;
//! - `State`: one variant per IR op, documented with its `.hol` location;
//! - `Machine`: the input, the variables, the state, and one field per holotype tag, constructed from the
//!   tag's arguments; its `step` runs ops until a sample request or the end;
//! - compile-time assertions that each holotype implements `Holotype` and declares every keyword the file
//!   gives it.
//!
//! The same module is emitted by `include_holoware!`, `holoware!`, [`crate::build`] and `holoc expand`.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};

use crate::ir::{
    ArgValue, Constraint, ConstraintArgument, HolotypeInstance, OpKind, Program, Role, Source,
    TemplateValue,
};
use crate::span;

/// How to emit one holoware.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The module's name.
    pub module: Ident,
    /// The file name used in locations (`tool.hol:29:1`) and messages.
    pub display_name: String,
    /// An absolute path to `include_bytes!`, so that cargo rebuilds when the file changes.
    pub track_path: Option<String>,
    /// The path under which holotypes are found (`crate::tools`); by default the parent module.
    pub holotypes: Option<TokenStream>,
    /// The span given to the paths and assertions that rustc may report errors at.
    pub span: Span,
}

impl Settings {
    pub fn new(module: Ident, display_name: impl Into<String>) -> Self {
        Settings {
            module,
            display_name: display_name.into(),
            track_path: None,
            holotypes: None,
            span: Span::call_site(),
        }
    }
}

/// A module name from a file name: `tool.hol` → `tool`, `my-env.hol` → `my_env`.
pub fn module_name(file_stem: &str) -> Ident {
    ident(&crate::ast::to_snake_identifier(file_stem))
}

/// An identifier for a variable or module name, made raw (`r#type`) or suffixed (`self_`) when it is a
/// Rust keyword.
fn ident(name: &str) -> Ident {
    if syn::parse_str::<Ident>(name).is_ok() {
        return format_ident!("{}", name);
    }
    match name {
        "self" | "Self" | "super" | "crate" | "_" => format_ident!("{}_", name),
        _ => Ident::new_raw(name, Span::call_site()),
    }
}

/// The module for a program.
pub fn module(program: &Program, settings: &Settings) -> TokenStream {
    Generator { program, settings }.module()
}

/// A module with the same public types and no behaviour, emitted beside `compile_error!` so that code
/// using the module does not add errors of its own.
pub fn skeleton(settings: &Settings) -> TokenStream {
    let module = &settings.module;
    quote! {
        #[allow(dead_code)]
        pub mod #module {
            #[derive(Debug, Clone, ::holo_runtime::serde::Deserialize)]
            #[serde(crate = "::holo_runtime::serde")]
            pub struct Input {}
            #[derive(Debug, Clone, Default)]
            pub struct Vars {}
            pub struct Machine {
                pub input: Input,
                pub vars: Vars,
            }
            impl ::holo_runtime::Machine for Machine {
                type Input = Input;
                fn with_resources(
                    input: Input,
                    _: &::holo_runtime::Resources,
                ) -> ::core::result::Result<Self, ::holo_runtime::RolloutError> {
                    ::core::result::Result::Ok(Machine { input, vars: Vars {} })
                }
            }
            impl ::holo_runtime::Rollout for Machine {
                fn step(
                    &mut self,
                    _: &mut dyn ::holo_runtime::Recorder,
                ) -> ::core::result::Result<::holo_runtime::Step, ::holo_runtime::RolloutError> {
                    ::core::unreachable!("the holoware did not compile")
                }
                fn resume(
                    &mut self,
                    _: ::holo_runtime::Completion,
                    _: &mut dyn ::holo_runtime::Recorder,
                ) -> ::core::result::Result<(), ::holo_runtime::RolloutError> {
                    ::core::unreachable!("the holoware did not compile")
                }
            }
        }
    }
}

/// The module as formatted Rust source, for `holoc expand` and build scripts.
pub fn pretty(tokens: TokenStream) -> String {
    match syn::parse2::<syn::File>(tokens.clone()) {
        Ok(file) => prettyplease::unparse(&file),
        Err(_) => tokens.to_string(),
    }
}

struct Generator<'a> {
    program: &'a Program,
    settings: &'a Settings,
}

impl Generator<'_> {
    fn location(&self, at: span::Span) -> String {
        format!(
            "{}:{}:{}",
            self.settings.display_name, at.start.line, at.start.col
        )
    }

    fn state(index: usize) -> Ident {
        format_ident!("Op{}", index)
    }

    /// The state after op `index`: the next op, or the end.
    fn next_state(&self, index: usize) -> TokenStream {
        self.state_at(index + 1)
    }

    fn state_at(&self, index: usize) -> TokenStream {
        if index < self.program.ops.len() {
            let state = Self::state(index);
            quote!(State::#state)
        } else {
            quote!(State::End)
        }
    }

    fn holotype_path(&self, holotype: &HolotypeInstance) -> TokenStream {
        let name = format_ident!("{}", holotype.name, span = self.settings.span);
        match &self.settings.holotypes {
            Some(path) => quote_spanned!(self.settings.span=> #path::#name),
            None if holotype.builtin => {
                quote_spanned!(self.settings.span=> ::holo_runtime::holotypes::#name)
            }
            None => quote_spanned!(self.settings.span=> super::#name),
        }
    }

    fn module(&self) -> TokenStream {
        let program = self.program;
        let settings = self.settings;
        let module = &settings.module;
        let display_name = &settings.display_name;
        let module_doc = format!(
            "The state machine compiled from `{display_name}`: {} ops, {} inputs, {} sampler bindings, {} holotype tags.",
            program.ops.len(),
            program.inputs.len(),
            program.bindings.len(),
            program.holotypes.len()
        );
        let track = settings.track_path.as_ref().map(|path| {
            quote! {
                const _: &[u8] = ::core::include_bytes!(#path);
            }
        });

        let input_names = program.inputs.iter().map(|input| &input.name);
        let required_names = program
            .inputs
            .iter()
            .filter(|input| input.required)
            .map(|input| &input.name);
        let binding_names = program.bindings.iter().map(|binding| &binding.name);
        let input_fields = program.inputs.iter().map(|input| {
            let field = ident(&input.name);
            let name = &input.name;
            let uses: Vec<String> = input.uses.iter().map(|at| self.location(*at)).collect();
            let doc = format!("`{name}`, used at {}.", uses.join(", "));
            let ty = if input.required {
                quote!(::holo_runtime::Text)
            } else {
                quote!(::core::option::Option<::holo_runtime::Text>)
            };
            let default = (!input.required).then(|| quote!(#[serde(default)]));
            let rename = (field != name.as_str()).then(|| quote!(#[serde(rename = #name)]));
            quote! {
                #[doc = #doc]
                #rename
                #default
                pub #field: #ty,
            }
        });
        let var_fields = program.bindings.iter().map(|binding| {
            let field = ident(&binding.name);
            let at: Vec<String> = binding
                .samplers
                .iter()
                .map(|op| self.location(program.ops[*op].span))
                .collect();
            let doc = format!(
                "`{}`, bound by the sampler at {}.",
                binding.name,
                at.join(", ")
            );
            quote! {
                #[doc = #doc]
                pub #field: ::core::option::Option<::std::string::String>,
            }
        });
        let variable_arms = program
            .inputs
            .iter()
            .map(|input| {
                let field = ident(&input.name);
                let name = &input.name;
                if input.required {
                    quote!(#name => ::core::option::Option::Some(self.input.#field.as_str()),)
                } else {
                    quote!(#name => self.input.#field.as_ref().map(::holo_runtime::Text::as_str),)
                }
            })
            .chain(program.bindings.iter().map(|binding| {
                let field = ident(&binding.name);
                let name = &binding.name;
                quote!(#name => self.vars.#field.as_deref(),)
            }));

        let states = program.ops.iter().enumerate().map(|(index, op)| {
            let state = Self::state(index);
            let doc = format!(
                "{}: {}",
                self.location(op.span),
                describe(&op.kind, program)
            );
            quote! {
                #[doc = #doc]
                #state,
            }
        });
        let holotype_fields = program
            .holotypes
            .iter()
            .enumerate()
            .map(|(index, holotype)| {
                let field = format_ident!("h{}", index);
                let path = self.holotype_path(holotype);
                let doc = format!(
                    "`<|{}|>` at {}.",
                    holotype.name,
                    self.location(holotype.span)
                );
                quote! {
                    #[doc = #doc]
                    #field: #path,
                }
            });
        let holotype_inits = program.holotypes.iter().enumerate().map(|(index, holotype)| {
            let field = format_ident!("h{}", index);
            let path = self.holotype_path(holotype);
            let location = self.location(holotype.span);
            let positional = holotype
                .args
                .iter()
                .filter(|arg| arg.name.is_none())
                .map(|arg| arg_value(&arg.value));
            let keywords = holotype.args.iter().filter_map(|arg| {
                let name = arg.name.as_ref()?;
                let value = arg_value(&arg.value);
                Some(quote!((#name, #value)))
            });
            quote! {
                #field: <#path as ::holo_runtime::Holotype>::new(&::holo_runtime::Args {
                    location: #location,
                    positional: ::std::vec![#(#positional),*],
                    keywords: ::std::vec![#(#keywords),*],
                    resources: resources.clone(),
                })
                .map_err(|error| ::holo_runtime::RolloutError::Holotype { location: #location, error })?,
            }
        });
        let holotype_assertions = program.holotypes.iter().map(|holotype| {
            let path = self.holotype_path(holotype);
            let (line, col) = (holotype.span.start.line, holotype.span.start.col);
            let span = self.settings.span;
            quote_spanned! {span=>
                const _: () = ::holo_runtime::__private::assert_holotype::<#path, #line, #col>();
            }
        });
        let assertions = program.holotypes.iter().flat_map(|holotype| {
            let path = self.holotype_path(holotype);
            holotype.args.iter().filter_map(move |arg| {
                let name = arg.name.as_ref()?;
                let message = format!(
                    "{}: holotype `{}` has no parameter `{name}` (see `{}::PARAMS`)",
                    self.location(arg.span),
                    holotype.name,
                    holotype.name
                );
                let span = self.settings.span;
                Some(quote_spanned! {span=>
                    const _: () = ::core::assert!(
                        ::holo_runtime::__private::has_param::<#path>(#name),
                        #message
                    );
                })
            })
        });
        let holotype_count = program.holotypes.len();
        let ends = (0..program.holotypes.len()).map(|index| {
            let field = format_ident!("h{}", index);
            let location = self.location(program.holotypes[index].span);
            quote! {
                {
                    let view = View { input: &self.input, vars: &self.vars };
                    let mut cx = ::holo_runtime::Cx::new(&mut *recorder, &view, self.passes[#index]);
                    ::holo_runtime::Holotype::end(&mut self.#field, &mut cx)
                        .map_err(|error| ::holo_runtime::RolloutError::Holotype { location: #location, error })?;
                }
            }
        });
        let step_arms = program
            .ops
            .iter()
            .enumerate()
            .map(|(index, op)| self.step_arm(index, &op.kind, op.span));
        let resume_arms = program.ops.iter().enumerate().filter_map(|(index, op)| {
            let OpKind::Sample(sample) = &op.kind else {
                return None;
            };
            let state = Self::state(index);
            let next = self.next_state(index);
            let fence_close = sample.fence.as_ref().map(|fence| {
                let close = format!("</{fence}>");
                quote! {
                    if !completion.closes_fence(#fence) {
                        recorder.text(#close);
                    }
                }
            });
            let fence = match &sample.fence {
                Some(fence) => quote!(::core::option::Option::Some(#fence)),
                None => quote!(::core::option::Option::None),
            };
            let bind = sample.binding.as_ref().map(|binding| {
                let field = ident(binding);
                quote! {
                    self.vars.#field = ::core::option::Option::Some(completion.bound_text(#fence).to_string());
                }
            });
            Some(quote! {
                State::#state => {
                    recorder.completion(&completion);
                    #fence_close
                    #bind
                    self.state = #next;
                }
            })
        });
        let first_state = self.state_at(0);
        let row_checks = self.row_checks();

        quote! {
            #[doc = #module_doc]
            #[allow(dead_code, unused_imports, unused_mut, unused_variables, unreachable_code, non_camel_case_types, clippy::all)]
            pub mod #module {
                /// The `.hol` file this module was compiled from.
                pub const SOURCE: &str = #display_name;
                /// The input variables, as they are named in data rows.
                pub const INPUTS: &[&str] = &[#(#input_names),*];
                /// The input variables that every data row must have.
                pub const REQUIRED_INPUTS: &[&str] = &[#(#required_names),*];
                /// The variables that samplers bind.
                pub const BINDINGS: &[&str] = &[#(#binding_names),*];
                #track

                /// One data row: the variables that no sampler binds, and the row's other columns.
                #[derive(Debug, Clone, ::holo_runtime::serde::Deserialize)]
                #[serde(crate = "::holo_runtime::serde")]
                pub struct Input {
                    #(#input_fields)*
                    /// The row's other columns, which holotypes can read (a reward's expected answer).
                    #[serde(flatten)]
                    pub extra: ::std::collections::BTreeMap<
                        ::std::string::String,
                        ::core::option::Option<::holo_runtime::Text>,
                    >,
                }

                /// The variables bound by samplers so far.
                #[derive(Debug, Clone, Default)]
                pub struct Vars {
                    #(#var_fields)*
                }

                /// The op the machine runs next.
                #[derive(Debug, Clone, Copy, PartialEq, Eq)]
                pub enum State {
                    #(#states)*
                    /// Every op ran; the `end` hooks run next.
                    End,
                    /// The rollout is over.
                    Done,
                }

                /// One rollout of the holoware.
                pub struct Machine {
                    pub input: Input,
                    pub vars: Vars,
                    pub state: State,
                    awaiting: bool,
                    role: ::core::option::Option<::holo_runtime::Role>,
                    passes: [u32; #holotype_count],
                    #(#holotype_fields)*
                }

                #(#holotype_assertions)*
                #(#assertions)*

                struct View<'a> {
                    input: &'a Input,
                    vars: &'a Vars,
                }

                impl ::holo_runtime::Variables for View<'_> {
                    fn get(&self, name: &str) -> ::core::option::Option<&str> {
                        match name {
                            #(#variable_arms)*
                            _ => self.input.extra.get(name)?.as_ref().map(::holo_runtime::Text::as_str),
                        }
                    }
                }

                impl Machine {
                    fn finish(
                        &mut self,
                        recorder: &mut dyn ::holo_runtime::Recorder,
                    ) -> ::core::result::Result<::holo_runtime::Step, ::holo_runtime::RolloutError> {
                        self.state = State::Done;
                        #(#ends)*
                        ::core::result::Result::Ok(::holo_runtime::Step::Done)
                    }

                    /// Starts an assistant message unless the current message is one.
                    fn assistant(&mut self, recorder: &mut dyn ::holo_runtime::Recorder) {
                        if self.role != ::core::option::Option::Some(::holo_runtime::Role::Assistant) {
                            recorder.begin_message(::holo_runtime::Role::Assistant);
                            self.role = ::core::option::Option::Some(::holo_runtime::Role::Assistant);
                        }
                    }
                }

                impl ::holo_runtime::Machine for Machine {
                    type Input = Input;

                    fn with_resources(
                        input: Input,
                        resources: &::holo_runtime::Resources,
                    ) -> ::core::result::Result<Self, ::holo_runtime::RolloutError> {
                        #(#row_checks)*
                        ::core::result::Result::Ok(Machine {
                            input,
                            vars: Vars::default(),
                            state: #first_state,
                            awaiting: false,
                            role: ::core::option::Option::None,
                            passes: [0; #holotype_count],
                            #(#holotype_inits)*
                        })
                    }
                }

                impl ::holo_runtime::Rollout for Machine {

                    fn step(
                        &mut self,
                        recorder: &mut dyn ::holo_runtime::Recorder,
                    ) -> ::core::result::Result<::holo_runtime::Step, ::holo_runtime::RolloutError> {
                        if self.awaiting {
                            return ::core::result::Result::Err(::holo_runtime::RolloutError::Protocol(
                                "step called while a completion is awaited",
                            ));
                        }
                        loop {
                            match self.state {
                                #(#step_arms)*
                                State::End => return self.finish(recorder),
                                State::Done => return ::core::result::Result::Ok(::holo_runtime::Step::Done),
                            }
                        }
                    }

                    fn resume(
                        &mut self,
                        completion: ::holo_runtime::Completion,
                        recorder: &mut dyn ::holo_runtime::Recorder,
                    ) -> ::core::result::Result<(), ::holo_runtime::RolloutError> {
                        if !self.awaiting {
                            return ::core::result::Result::Err(::holo_runtime::RolloutError::Protocol(
                                "resume called without a pending sample request",
                            ));
                        }
                        self.awaiting = false;
                        match self.state {
                            #(#resume_arms)*
                            _ => {
                                return ::core::result::Result::Err(::holo_runtime::RolloutError::Protocol(
                                    "resume called in a state that does not sample",
                                ))
                            }
                        }
                        ::core::result::Result::Ok(())
                    }
                }
            }
        }
    }

    /// Checks, before the rollout starts, that the row has one of each group of alternatives made only of
    /// optional inputs (a required input is in every row that deserializes).
    fn row_checks(&self) -> Vec<TokenStream> {
        let optional_input = |name: &str| {
            self.program
                .inputs
                .iter()
                .any(|input| input.name == name && !input.required)
        };
        self.program
            .ops
            .iter()
            .filter_map(|op| {
                let OpKind::Insert { alternatives } = &op.kind else {
                    return None;
                };
                let names: Vec<&str> = alternatives
                    .iter()
                    .map(|source| match source {
                        Source::Variable(name) if optional_input(name) => Some(name.as_str()),
                        _ => None,
                    })
                    .collect::<Option<_>>()?;
                let fields = names.iter().map(|name| ident(name));
                let location = self.location(op.span);
                Some(quote! {
                    if #(input.#fields.is_none())&&* {
                        return ::core::result::Result::Err(::holo_runtime::RolloutError::MissingVariable {
                            location: #location,
                            alternatives: &[#(#names),*],
                        });
                    }
                })
            })
            .collect()
    }

    fn step_arm(&self, index: usize, op: &OpKind, at: span::Span) -> TokenStream {
        let state = Self::state(index);
        let next = self.next_state(index);
        let location = self.location(at);
        let body = match op {
            OpKind::Context { trained, template } if template.is_empty() => quote! {
                recorder.begin_context(#trained);
                self.role = ::core::option::Option::None;
                self.state = #next;
            },
            OpKind::Context { trained, template } => {
                let arguments = template.iter().map(|argument| {
                    let name = &argument.name;
                    let value = match &argument.value {
                        TemplateValue::Bool(value) => {
                            quote! { ::holo_runtime::TemplateArg::Bool(#value) }
                        }
                        TemplateValue::Number(value) => {
                            quote! { ::holo_runtime::TemplateArg::Number(#value) }
                        }
                        TemplateValue::Text(text) => {
                            quote! { ::holo_runtime::TemplateArg::Text(#text) }
                        }
                    };
                    quote! { (#name, #value) }
                });
                quote! {
                    recorder.begin_context(#trained);
                    recorder
                        .template_arguments(&[#(#arguments),*])
                        .map_err(|error| ::holo_runtime::RolloutError::Template { location: #location, error })?;
                    self.role = ::core::option::Option::None;
                    self.state = #next;
                }
            }
            OpKind::Role { role } => {
                let role = role_tokens(*role);
                quote! {
                    recorder.begin_message(#role);
                    self.role = ::core::option::Option::Some(#role);
                    self.state = #next;
                }
            }
            OpKind::Text { text } => quote! {
                recorder.text(#text);
                self.state = #next;
            },
            OpKind::Insert { alternatives } => {
                let sources = alternatives.iter().map(|source| match source {
                    Source::Literal(text) => quote!(::core::option::Option::Some(#text)),
                    Source::Variable(name) => quote!(::holo_runtime::Variables::get(&view, #name)),
                });
                let names: Vec<&str> = alternatives
                    .iter()
                    .filter_map(|source| match source {
                        Source::Variable(name) => Some(name.as_str()),
                        Source::Literal(_) => None,
                    })
                    .collect();
                quote! {
                    let view = View { input: &self.input, vars: &self.vars };
                    let value = [#(#sources),*].into_iter().flatten().next();
                    match value {
                        ::core::option::Option::Some(value) => recorder.text(value),
                        ::core::option::Option::None => {
                            return ::core::result::Result::Err(::holo_runtime::RolloutError::MissingVariable {
                                location: #location,
                                alternatives: &[#(#names),*],
                            })
                        }
                    }
                    self.state = #next;
                }
            }
            OpKind::Sample(sample) => {
                let optional = |value: Option<TokenStream>| match value {
                    Some(value) => quote!(::core::option::Option::Some(#value)),
                    None => quote!(::core::option::Option::None),
                };
                let binding = optional(sample.binding.as_ref().map(|name| quote!(#name)));
                let fence = optional(sample.fence.as_ref().map(|name| quote!(#name)));
                let max_tokens = optional(sample.max_tokens.map(|value| quote!(#value)));
                let temperature = optional(sample.temperature.map(|value| quote!(#value)));
                let top_p = optional(sample.top_p.map(|value| quote!(#value)));
                let top_k = optional(sample.top_k.map(|value| quote!(#value)));
                let constraint = match &sample.constraint_variable {
                    // The text is the variable's value now: read, checked and fenced at each request.
                    Some(variable) => {
                        let argument = format_ident!(
                            "{}",
                            match variable.argument {
                                ConstraintArgument::JsonSchema => "JsonSchema",
                                ConstraintArgument::Regex => "Regex",
                                ConstraintArgument::Grammar => "Grammar",
                            }
                        );
                        let name = &variable.name;
                        quote! {
                            ::core::option::Option::Some({
                                let view = View { input: &self.input, vars: &self.vars };
                                ::holo_runtime::__private::constraint_of(
                                    ::holo_runtime::__private::ConstraintArgument::#argument,
                                    #name,
                                    ::holo_runtime::Variables::get(&view, #name),
                                    #fence,
                                    #location,
                                )?
                            })
                        }
                    }
                    None => optional(sample.constraint.as_ref().map(constraint)),
                };
                let open = sample.fence.as_ref().map(|fence| {
                    let open = format!("<{fence}>");
                    quote!(recorder.text(#open);)
                });
                let stops = sample
                    .fence
                    .iter()
                    .map(|fence| format!("</{fence}>"))
                    .chain(sample.stop.iter().cloned());
                quote! {
                    self.assistant(recorder);
                    #open
                    self.awaiting = true;
                    return ::core::result::Result::Ok(::holo_runtime::Step::Sample(::holo_runtime::SampleRequest {
                        binding: #binding,
                        fence: #fence,
                        max_tokens: #max_tokens,
                        temperature: #temperature,
                        top_p: #top_p,
                        top_k: #top_k,
                        stop: ::std::vec![#(::std::string::String::from(#stops)),*],
                        constraint: #constraint,
                        location: #location,
                    }));
                }
            }
            OpKind::Holotype { instance, body_end } => {
                let field = format_ident!("h{}", instance);
                let (run, skip) = match body_end {
                    Some(end) => (self.next_state(index), self.next_state(*end)),
                    None => (next.clone(), next.clone()),
                };
                let reset = body_end.map(|_| quote!(self.passes[#instance] = 0;));
                quote! {
                    #reset
                    let view = View { input: &self.input, vars: &self.vars };
                    let mut cx = ::holo_runtime::Cx::new(&mut *recorder, &view, self.passes[#instance]);
                    let enter = ::holo_runtime::Holotype::enter(&mut self.#field, &mut cx)
                        .map_err(|error| ::holo_runtime::RolloutError::Holotype { location: #location, error })?;
                    self.state = match enter {
                        ::holo_runtime::Enter::Run => #run,
                        ::holo_runtime::Enter::Skip => #skip,
                        ::holo_runtime::Enter::Stop => return self.finish(recorder),
                    };
                }
            }
            OpKind::EndBody {
                instance,
                body_start,
            } => {
                let field = format_ident!("h{}", instance);
                let start = self.state_at(*body_start);
                let location = self.location(self.program.holotypes[*instance].span);
                quote! {
                    self.passes[#instance] += 1;
                    let view = View { input: &self.input, vars: &self.vars };
                    let mut cx = ::holo_runtime::Cx::new(&mut *recorder, &view, self.passes[#instance]);
                    let pass = ::holo_runtime::Holotype::end_pass(&mut self.#field, &mut cx)
                        .map_err(|error| ::holo_runtime::RolloutError::Holotype { location: #location, error })?;
                    self.state = match pass {
                        ::holo_runtime::Pass::Repeat => #start,
                        ::holo_runtime::Pass::Done => #next,
                        ::holo_runtime::Pass::Stop => return self.finish(recorder),
                    };
                }
            }
        };
        quote! {
            State::#state => {
                #body
            }
        }
    }
}

fn role_tokens(role: Role) -> TokenStream {
    match role {
        Role::System => quote!(::holo_runtime::Role::System),
        Role::User => quote!(::holo_runtime::Role::User),
        Role::Assistant => quote!(::holo_runtime::Role::Assistant),
    }
}

fn arg_value(value: &ArgValue) -> TokenStream {
    match value {
        ArgValue::Word(word) => {
            quote!(::holo_runtime::ArgValue::Word(::std::string::String::from(#word)))
        }
        ArgValue::Str(text) => {
            quote!(::holo_runtime::ArgValue::Str(::std::string::String::from(#text)))
        }
        ArgValue::Int(int) => quote!(::holo_runtime::ArgValue::Int(#int)),
        ArgValue::Float(float) => quote!(::holo_runtime::ArgValue::Float(#float)),
    }
}

/// One line on an op, for the `State` docs.
fn describe(op: &OpKind, program: &Program) -> String {
    match op {
        OpKind::Context { trained: true, .. } => "start a trained context".to_string(),
        OpKind::Context { trained: false, .. } => "start an untrained context".to_string(),
        OpKind::Role { role } => format!("start a {} message", role.name()),
        OpKind::Text { text } => {
            let shown: String = text.chars().take(40).collect();
            let more = if text.chars().count() > 40 { "…" } else { "" };
            format!("text {shown:?}{more}")
        }
        OpKind::Insert { alternatives } => {
            let names: Vec<String> = alternatives
                .iter()
                .map(|source| match source {
                    Source::Variable(name) => name.clone(),
                    Source::Literal(text) => format!("{text:?}"),
                })
                .collect();
            format!("insert {}", names.join(" | "))
        }
        OpKind::Sample(sample) => match &sample.binding {
            Some(binding) => format!("sample into `{binding}`"),
            None => "sample".to_string(),
        },
        OpKind::Holotype { instance, .. } => {
            format!("enter holotype `{}`", program.holotypes[*instance].name)
        }
        OpKind::EndBody { instance, .. } => {
            format!(
                "end of a pass through the body of `{}`",
                program.holotypes[*instance].name
            )
        }
    }
}

/// The runtime's `Constraint` for a sampler tag's constraint.
fn constraint(constraint: &Constraint) -> TokenStream {
    let string = |text: &String| quote!(::std::string::String::from(#text));
    match constraint {
        Constraint::JsonObject => quote!(::holo_runtime::Constraint::JsonObject),
        Constraint::JsonSchema(text) => quote!(::holo_runtime::__private::json_schema(#text)),
        Constraint::Regex(regex) => {
            let regex = string(regex);
            quote!(::holo_runtime::Constraint::Regex(#regex))
        }
        Constraint::Choice(choices) => {
            let choices = choices.iter().map(string);
            quote!(::holo_runtime::Constraint::Choice(
                ::std::vec![#(#choices),*]
            ))
        }
        Constraint::Grammar(grammar) => {
            let grammar = string(grammar);
            quote!(::holo_runtime::Constraint::Lark(#grammar))
        }
    }
}
