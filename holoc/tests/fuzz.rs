//! Property tests: the whole front end never panics or overflows its stack, whatever the input, and
//! every diagnostic points inside the file; the formatter is idempotent and keeps the meaning of every
//! file it formats.

mod support;

use std::path::Path;

use holoc::{compile, Options, Output};
use proptest::prelude::*;

fn check_invariants(bytes: &[u8]) -> Output {
    let output = compile(bytes, &Options::default());
    for diagnostic in &output.diagnostics {
        let span = diagnostic.span();
        assert!(span.start.offset <= span.end.offset, "{diagnostic:?}");
        assert!(
            span.end.offset as usize <= output.source.len(),
            "{diagnostic:?}"
        );
        assert!(
            span.start.line >= 1 && span.start.col >= 1,
            "{diagnostic:?}"
        );
    }
    assert_eq!(output.program.is_some(), !output.has_errors());
    output
}

fn corpus_files() -> Vec<Vec<u8>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/corpus/errloom");
    let mut files = Vec::new();
    for dir in [root.clone(), root.join("history")] {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|extension| extension == "hol") {
                files.push(std::fs::read(path).unwrap());
            }
        }
    }
    files.sort();
    files
}

/// Text made of the characters that matter to the lexer and layout, so that most inputs reach the parser
/// and the checks.
fn holoware_like() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "<|",
        "|>",
        "|",
        "<>",
        "=",
        ":",
        "/",
        "\"",
        "'",
        "\\",
        "#",
        "\n",
        "\r\n",
        "\t",
        " ",
        "    ",
        "o_o",
        "@_@",
        "x_x",
        "+++",
        "===",
        "a",
        "turn",
        "Loop",
        "Tool",
        "max_tokens",
        "temperature",
        "stop",
        "1",
        "0.5",
        "-2",
        "é",
        "🙂",
        "text ",
    ]);
    prop::collection::vec(pieces, 0..80).prop_map(|pieces| pieces.concat())
}

/// Files made of whole lines that mostly lex and parse, with the layout the formatter rewrites: bodies at
/// odd indentations, tags with odd spacing, comments, blank lines with spaces, text with extra indentation,
/// CRLF line ends and a last line with or without a newline.
fn holoware_lines() -> impl Strategy<Value = String> {
    let content = prop::sample::select(vec![
        "<|o_o|>",
        "<| x_x |>",
        "<|@_@|>",
        "<|+++|>",
        "<| === |>",
        "<|@_@:turn|>",
        "<| @_@ : answer  <>answer max_tokens = 8|>",
        "<|Loop max_turns=2|>",
        "<|Tool  turn|>",
        "<|Outer|>",
        "<| Step |>",
        "<|/Loop|>",
        "<|query|>",
        "<| few_shot | \"none\" |>",
        "<|turn|\"\"|>",
        "text",
        "text  with  <| query |>  inside  ",
        "<|o_o|>   <|@_@:turn|>",
        "# comment  ",
        "\\# escaped",
        "",
        "   ",
    ]);
    let line = (0usize..10, content).prop_map(|(indent, content)| {
        if content.trim().is_empty() {
            content.to_string()
        } else {
            format!("{}{content}", " ".repeat(indent))
        }
    });
    (
        prop::collection::vec(line, 0..24),
        prop::sample::select(vec!["\n", "\r\n"]),
        any::<bool>(),
    )
        .prop_map(|(lines, newline, final_newline)| {
            let mut text = lines.join(newline);
            if final_newline {
                text.push_str(newline);
            }
            text
        })
}

#[derive(Debug, Clone)]
enum Mutation {
    Insert(usize, u8),
    Delete(usize),
    Replace(usize, u8),
    Duplicate(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert(at, byte)),
        any::<usize>().prop_map(Mutation::Delete),
        (
            any::<usize>(),
            prop::sample::select(b"<|>\n\t \"':=@_#/\\".to_vec())
        )
            .prop_map(|(at, byte)| Mutation::Replace(at, byte)),
        (any::<usize>(), 1usize..40).prop_map(|(at, len)| Mutation::Duplicate(at, len)),
    ]
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for mutation in mutations {
        let len = bytes.len().max(1);
        match *mutation {
            Mutation::Insert(at, byte) => bytes.insert(at % (bytes.len() + 1), byte),
            Mutation::Delete(at) if !bytes.is_empty() => {
                bytes.remove(at % len);
            }
            Mutation::Replace(at, byte) if !bytes.is_empty() => bytes[at % len] = byte,
            Mutation::Duplicate(at, count) if !bytes.is_empty() => {
                let start = at % len;
                let end = (start + count).min(bytes.len());
                let copy = bytes[start..end].to_vec();
                bytes.splice(start..start, copy);
            }
            _ => {}
        }
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        check_invariants(&bytes);
    }

    #[test]
    fn holoware_like_text(text in holoware_like()) {
        check_invariants(text.as_bytes());
    }

    #[test]
    fn mutated_corpus(file in 0usize..9, mutations in prop::collection::vec(mutation(), 1..8)) {
        let files = corpus_files();
        let bytes = apply(files[file % files.len()].clone(), &mutations);
        check_invariants(&bytes);
    }

    #[test]
    fn format_holoware_like_text(text in holoware_like()) {
        support::format_checked(&text);
    }

    #[test]
    fn format_holoware_lines(text in holoware_lines()) {
        support::format_checked(&text);
    }

    #[test]
    fn format_mutated_corpus(file in 0usize..9, mutations in prop::collection::vec(mutation(), 1..8)) {
        let files = corpus_files();
        let bytes = apply(files[file % files.len()].clone(), &mutations);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            support::format_checked(text);
        }
    }
}

/// `depth` holotype tags, each opening a body one column deeper, around a sampler.
fn nested_bodies(depth: usize) -> String {
    let mut source = String::new();
    for level in 0..depth {
        source.push_str(&" ".repeat(level));
        source.push_str("<|Level|>\n");
    }
    source.push_str(&" ".repeat(depth));
    source.push_str("<|@_@:deep|>\n");
    source
}

/// Bodies nested far beyond the limit: one diagnostic, no stack overflow.
#[test]
fn deeply_nested_bodies() {
    let depth = 1500;
    let source = nested_bodies(depth);
    let output = check_invariants(source.as_bytes());
    let codes: Vec<&str> = output.diagnostics.iter().map(|d| d.code.id()).collect();
    assert_eq!(codes, ["H0024"]);
}

/// The deepest nesting allowed compiles, with a body per level.
#[test]
fn nesting_at_the_limit() {
    let depth = holoc::lexer::MAX_NESTING;
    let source = nested_bodies(depth);
    let output = check_invariants(source.as_bytes());
    assert!(!output.has_errors(), "{:?}", output.diagnostics);
    let program = output.program.unwrap();
    assert_eq!(program.holotypes.len(), depth);
    assert!(program.holotypes.iter().all(|holotype| {
        matches!(
            program.ops[holotype.op].kind,
            holoc::ir::OpKind::Holotype {
                body_end: Some(_),
                ..
            }
        )
    }));
}

/// Long flat inputs: many tags on a line, many lines, a huge line.
#[test]
fn large_flat_inputs() {
    let many_tags = "<|o_o|><|name|>".repeat(20_000);
    check_invariants(many_tags.as_bytes());
    let many_lines = "<|o_o|>\ntext <|x|>\n<|@_@:y|>\n".repeat(10_000);
    check_invariants(many_lines.as_bytes());
    let long_line = "a".repeat(1_000_000);
    check_invariants(long_line.as_bytes());
    let many_pipes = format!("<|{}a|>", "a|".repeat(50_000));
    check_invariants(many_pipes.as_bytes());
}
