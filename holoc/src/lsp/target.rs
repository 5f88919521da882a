//! What a position of a document points at: the part of a tag under the cursor, found in the syntax tree.

use std::collections::BTreeMap;

use crate::ast::{Alternative, Arg, ContextMarker, Head, Node, Role, Tag};
use crate::span::{Span, Spanned};

/// The part of a tag at a position.
pub(crate) enum Target<'a> {
    /// A role glyph; `sampler` when the tag samples (a binding or arguments).
    Role {
        role: Role,
        sampler: bool,
    },
    /// The variable a sampler binds: `answer` in `<|@_@:answer|>`.
    Binding(&'a Spanned<String>),
    Context(ContextMarker),
    /// A holotype's name, in its tag or in a closing tag.
    Holotype(&'a Spanned<String>),
    /// A variable inserted by a value tag.
    Variable {
        name: &'a str,
        span: Span,
    },
    /// A keyword argument's name; `holotype` is the tag's holotype, `None` for a sampler.
    Argument {
        holotype: Option<&'a str>,
        name: &'a Spanned<String>,
    },
    /// A sampler's fence name.
    Fence(&'a Spanned<String>),
}

fn contains(span: Span, offset: usize) -> bool {
    (span.start.offset as usize..=span.end.offset as usize).contains(&offset)
}

/// The innermost tag whose span holds `offset`, with the span of the tag.
pub(crate) fn tag_at(nodes: &[Node], offset: usize) -> Option<(&Tag, Span)> {
    for node in nodes {
        let Node::Tag(tag) = node else { continue };
        if contains(tag.span, offset) {
            return Some((&tag.node, tag.span));
        }
        if let Some(body) = &tag.node.body {
            if let Some(found) = tag_at(&body.nodes, offset) {
                return Some(found);
            }
        }
    }
    None
}

/// The part of the tag at `offset`.
pub(crate) fn target_at(nodes: &[Node], offset: usize) -> Option<Target<'_>> {
    let (tag, _) = tag_at(nodes, offset)?;
    let head = match &tag.head {
        Head::Role { role, binding } => {
            if let Some(binding) = binding.as_ref().filter(|b| contains(b.span, offset)) {
                return Some(Target::Binding(binding));
            }
            contains(role.span, offset).then_some(Target::Role {
                role: role.node,
                sampler: binding.is_some() || !tag.args.is_empty(),
            })
        }
        Head::Context(marker) => {
            contains(marker.span, offset).then_some(Target::Context(marker.node))
        }
        Head::Close(name) | Head::Holotype(name) => {
            contains(name.span, offset).then_some(Target::Holotype(name))
        }
        Head::Value(alternatives) => alternatives
            .iter()
            .find_map(|alternative| match &alternative.node {
                Alternative::Variable(name) if contains(alternative.span, offset) => {
                    Some(Target::Variable {
                        name,
                        span: alternative.span,
                    })
                }
                _ => None,
            }),
    };
    if head.is_some() {
        return head;
    }
    let holotype = match &tag.head {
        Head::Holotype(name) => Some(name.node.as_str()),
        _ => None,
    };
    tag.args.iter().find_map(|arg| match &arg.node {
        Arg::Keyword { name, .. } if contains(name.span, offset) => {
            Some(Target::Argument { holotype, name })
        }
        Arg::Fence(name) if contains(arg.span, offset) => Some(Target::Fence(name)),
        _ => None,
    })
}

/// The variables a document names: where samplers bind each one and where each is inserted.
#[derive(Default)]
pub(crate) struct Variables<'a> {
    /// Binding spans per variable, in source order.
    pub(crate) bindings: BTreeMap<&'a str, Vec<Span>>,
    /// Uses per variable: the span, and whether the use is the tag's only alternative.
    pub(crate) uses: BTreeMap<&'a str, Vec<(Span, bool)>>,
}

impl<'a> Variables<'a> {
    pub(crate) fn of(nodes: &'a [Node]) -> Self {
        let mut variables = Variables::default();
        variables.collect(nodes);
        variables
    }

    fn collect(&mut self, nodes: &'a [Node]) {
        for node in nodes {
            let Node::Tag(tag) = node else { continue };
            match &tag.node.head {
                Head::Role {
                    binding: Some(binding),
                    ..
                } => self
                    .bindings
                    .entry(binding.node.as_str())
                    .or_default()
                    .push(binding.span),
                Head::Value(alternatives) => {
                    let sole = alternatives.len() == 1;
                    for alternative in alternatives {
                        if let Alternative::Variable(name) = &alternative.node {
                            self.uses
                                .entry(name.as_str())
                                .or_default()
                                .push((alternative.span, sole));
                        }
                    }
                }
                _ => {}
            }
            if let Some(body) = &tag.node.body {
                self.collect(&body.nodes);
            }
        }
    }
}
