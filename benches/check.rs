//! Parse + check throughput of the holoc front end, in bytes/s: on the errloom corpus, and on generated
//! holowares of 1x, 10x and 100x size to show that the cost is linear in the input.
//!
//! Run with `cargo bench -p holoc`; criterion prints MiB/s per group.

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use holoc::{compile, Options};

fn corpus() -> Vec<Vec<u8>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/corpus/errloom");
    let mut files = Vec::new();
    for dir in [root.clone(), root.join("history")] {
        for entry in std::fs::read_dir(dir).expect("the corpus is in the repo") {
            let path = entry.expect("readable").path();
            if path.extension().is_some_and(|extension| extension == "hol") {
                files.push(std::fs::read(path).expect("readable"));
            }
        }
    }
    files
}

/// A holoware of `blocks` multi-turn tool episodes, each with its own inputs and bindings, so that every
/// stage (layout, bodies, binding analysis) scales with the size.
fn generated(blocks: usize) -> String {
    let mut source = String::from("# generated benchmark holoware\n");
    for i in 0..blocks {
        source.push_str(&format!(
            "<|+++|>\n<|x_x|>\nYou are a careful assistant. Use tools when needed.\n<|ToolSchema|>\n\
             <|few_shot_{i}|\"\"|>\n\n<|o_o|>\n<|query_{i}|question_{i}|>\n\n\
             <|ToolRunner max_turns=8|>\n    # one turn\n    <|@_@:turn_{i} <>think max_tokens=512 temperature=0.7 stop=\"</tool>\"|>\n\
             \x20   <|o_o|>\n    <|ToolExecutor turn_{i}|>\n<|/ToolRunner|>\n\
             <|===|>\n<|o_o|>\nJudge this answer: <|turn_{i}|\"\"|>\n<|@_@:verdict_{i} <>verdict|>\n\
             <|Judge verdict_{i} weight=0.5|>\n\n"
        ));
    }
    source
}

fn bench(c: &mut Criterion) {
    let options = Options::default();

    let files = corpus();
    let total: usize = files.iter().map(Vec::len).sum();
    let mut group = c.benchmark_group("corpus");
    group.throughput(Throughput::Bytes(total as u64));
    group.bench_function("all 9 files", |b| {
        b.iter(|| {
            for file in &files {
                black_box(compile(black_box(file), &options));
            }
        })
    });
    group.finish();

    let mut group = c.benchmark_group("generated");
    for blocks in [10, 100, 1000] {
        let source = generated(blocks);
        assert!(!compile(source.as_bytes(), &options).has_errors());
        group.throughput(Throughput::Bytes(source.len() as u64));
        group.bench_function(
            format!("{}x ({} KiB)", blocks / 10, source.len() / 1024),
            |b| b.iter(|| black_box(compile(black_box(source.as_bytes()), &options))),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
