//! The machine's own ceilings, against which `benches/roofline.py` states the training step's arithmetic
//! rate and decoding's bandwidth: the f32 FMA peak and the read bandwidth from memory, on one core and on
//! two, and what decoding's one-row product (`Linear::forward` with `Ops::Fast`) reaches on weights that
//! do not fit in cache.
//!
//!     cargo run -p holo-model --example machine_peaks -- [--gb 1.5] [--repeats 5] [--only products]
//!
//! Every figure is the best of `--repeats` runs, timed by the wall clock and by the threads' own CPU time
//! (`/proc/thread-self/schedstat`, in nanoseconds): on a shared machine a thread descheduled mid-run
//! loses wall time but not CPU time, so the CPU-time rate is the hardware's and the wall rate what a run
//! got. Each run also reports the time its threads waited, runnable, for a core (the same file's second
//! field), and the report the load average before and after.
//!
//! - FMA: independent chains of `_mm512_fmadd_ps` (16 lanes) or `_mm256_fmadd_ps` (8 lanes), 8 to 12
//!   accumulators: an FMA's latency (4 cycles) times the two FMA ports needs 8 in flight. Two FLOP per
//!   lane; the clock implied assumes both ports (2 FMAs a cycle).
//! - Reads: a sum over a `--gb` buffer of f32 (larger than any cache here), split in halves for two
//!   threads: the 16-lane Rust loop that compiles to SSE2 (`plain`), AVX-512 loads into 4 or 8
//!   accumulators, and the 8-accumulator one with a software prefetch of each line 1, 4 or 16 KiB ahead
//!   (into L1, or non-temporal).
//! - Products: three f32 weights `[151,936, 896]` (Qwen2.5's output head, 545 MB each) in turn, 1 and 8
//!   rows, on candle's pool (`RAYON_NUM_THREADS`, which `--only products` runs alone): GB per wall
//!   second and per CPU second of the whole process, the pool's threads together.

use std::process::ExitCode;
use std::sync::Barrier;
use std::time::Instant;

use candle_core::{Device, Tensor};
use holo_model::model::Linear;
use holo_model::Ops;

/// FMAs per accumulator per run: 0.1–0.3 s of one core at these rates.
const FMA_ITERATIONS: u64 = 40_000_000;

fn main() -> ExitCode {
    holo_model::threads::settle();
    let mut args = std::env::args().skip(1);
    let (mut gb, mut repeats, mut products_only) = (1.5f64, 5usize, false);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_default();
        match arg.as_str() {
            "--gb" => match value.parse() {
                Ok(parsed) if parsed > 0.0 => gb = parsed,
                _ => return usage("--gb takes a positive number"),
            },
            "--repeats" => match value.parse::<usize>() {
                Ok(parsed) => repeats = parsed.max(1),
                _ => return usage("--repeats takes a number"),
            },
            "--only" if value == "products" => products_only = true,
            _ => return usage(&format!("unknown argument {arg} {value}")),
        }
    }
    if !std::arch::is_x86_feature_detected!("avx512f")
        || !std::arch::is_x86_feature_detected!("fma")
    {
        eprintln!("error: this benchmark needs AVX-512F and FMA");
        return ExitCode::FAILURE;
    }
    let load_before = load_average();
    let mut report = serde_json::Map::new();
    if !products_only {
        report.insert("fma".into(), fma(repeats));
        report.insert("read".into(), read(gb, repeats));
    }
    match products(repeats) {
        Ok(measured) => report.insert("products".into(), measured),
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    report.insert("load_average_before".into(), load_before.into());
    report.insert("load_average_after".into(), load_average().into());
    println!("{}", serde_json::Value::Object(report));
    ExitCode::SUCCESS
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("error: {problem}");
    eprintln!("usage: machine_peaks [--gb 1.5] [--repeats 5] [--only products]");
    ExitCode::from(2)
}

/// One thread's run: wall seconds, its own CPU seconds and the seconds it waited for a core.
#[derive(Clone, Copy)]
struct Timed {
    wall: f64,
    cpu: f64,
    waited: f64,
}

/// This thread's seconds on a core and waiting, runnable, for one (Linux; zeros elsewhere).
fn thread_clock() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut fields = stat
        .split_whitespace()
        .map(|field| field.parse::<f64>().unwrap_or(0.0) / 1e9);
    (fields.next().unwrap_or(0.0), fields.next().unwrap_or(0.0))
}

/// The same over all of this process's threads (candle's pool included).
fn process_clock() -> (f64, f64) {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return (0.0, 0.0);
    };
    tasks.flatten().fold((0.0, 0.0), |(cpu, waited), task| {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        let mut fields = stat
            .split_whitespace()
            .map(|field| field.parse::<f64>().unwrap_or(0.0) / 1e9);
        (
            cpu + fields.next().unwrap_or(0.0),
            waited + fields.next().unwrap_or(0.0),
        )
    })
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Runs `work` on `threads` threads started together (each gets its index), `repeats` times; returns
/// each repeat's threads' timings.
fn on_threads(threads: usize, repeats: usize, work: &(dyn Fn(usize) + Sync)) -> Vec<Vec<Timed>> {
    (0..repeats)
        .map(|_| {
            let start = Barrier::new(threads);
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..threads)
                    .map(|index| {
                        let start = &start;
                        scope.spawn(move || {
                            start.wait();
                            let (cpu, waited) = thread_clock();
                            let wall = Instant::now();
                            work(index);
                            let wall = wall.elapsed().as_secs_f64();
                            let (cpu_after, waited_after) = thread_clock();
                            Timed {
                                wall,
                                cpu: cpu_after - cpu,
                                waited: waited_after - waited,
                            }
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|handle| handle.join().expect("a measuring thread panicked"))
                    .collect()
            })
        })
        .collect()
}

/// A rate of `amount` per repeat (all threads together), best over repeats: by wall time (the slowest
/// thread's) and by CPU time (each thread's `amount / threads` over its own CPU seconds, summed), with
/// the waiting of the repeat that gave the best wall time.
fn rates(amount: f64, runs: &[Vec<Timed>]) -> serde_json::Value {
    let (mut wall, mut cpu, mut waited) = (0f64, 0f64, 0f64);
    for run in runs {
        let slowest = run.iter().map(|t| t.wall).fold(0.0, f64::max);
        if amount / slowest > wall {
            wall = amount / slowest;
            waited = run.iter().map(|t| t.waited).sum();
        }
        let share = amount / run.len() as f64;
        cpu = cpu.max(run.iter().map(|t| share / t.cpu).sum());
    }
    serde_json::json!({"per_wall_s": wall / 1e9, "per_cpu_s": cpu / 1e9, "waited_s": waited})
}

/// The FMA peak per core and on two cores, GFLOP/s, for each vector width and accumulator count.
fn fma(repeats: usize) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    // At 16 chains of `__m512` the compiler kept one in memory, a store and load per iteration: 12 at most.
    // The kernels' CPU features were checked in `main` (AVX-512F implies AVX2).
    type Chains = fn(u64) -> f32;
    let variants: [(&str, usize, Chains); 6] = [
        ("avx512_x8", 8 * 16, |n| unsafe { fma512::<8>(n) }),
        ("avx512_x10", 10 * 16, |n| unsafe { fma512::<10>(n) }),
        ("avx512_x12", 12 * 16, |n| unsafe { fma512::<12>(n) }),
        ("avx2_x8", 8 * 8, |n| unsafe { fma256::<8>(n) }),
        ("avx2_x10", 10 * 8, |n| unsafe { fma256::<10>(n) }),
        ("avx2_x12", 12 * 8, |n| unsafe { fma256::<12>(n) }),
    ];
    for (name, lanes, kernel) in variants {
        // Each lane's FMA is a multiply and an add.
        let flop = 2.0 * (lanes as u64 * FMA_ITERATIONS) as f64;
        let mut threads = serde_json::Map::new();
        for count in [1, 2] {
            let runs = on_threads(count, repeats, &|_| {
                std::hint::black_box(kernel(std::hint::black_box(FMA_ITERATIONS)));
            });
            threads.insert(
                format!("threads_{count}"),
                rates(flop * count as f64, &runs),
            );
        }
        out.insert(name.into(), threads.into());
    }
    out.into()
}

/// `N` independent chains of 16-lane FMAs, `iterations` each.
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f,fma")]
unsafe fn fma512<const N: usize>(iterations: u64) -> f32 {
    use std::arch::x86_64::*;
    // `x · a + b` converges to 1 and stays normal: no subnormal slow paths. The constants are opaque to
    // the compiler: with them known it folds the whole loop to its fixed point.
    let (a, b) = (
        _mm512_set1_ps(opaque(0.999_99)),
        _mm512_set1_ps(opaque(1e-5)),
    );
    let mut chains = [_mm512_set1_ps(opaque(2.0)); N];
    for _ in 0..iterations {
        for chain in chains.iter_mut() {
            *chain = _mm512_fmadd_ps(*chain, a, b);
        }
    }
    chains
        .iter()
        .map(|&chain| _mm512_reduce_add_ps(chain))
        .sum()
}

/// `N` independent chains of 8-lane FMAs, `iterations` each.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn fma256<const N: usize>(iterations: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (
        _mm256_set1_ps(opaque(0.999_99)),
        _mm256_set1_ps(opaque(1e-5)),
    );
    let mut chains = [_mm256_set1_ps(opaque(2.0)); N];
    for _ in 0..iterations {
        for chain in chains.iter_mut() {
            *chain = _mm256_fmadd_ps(*chain, a, b);
        }
    }
    let mut lanes = [0f32; 8];
    chains
        .iter()
        .map(|&chain| {
            _mm256_storeu_ps(lanes.as_mut_ptr(), chain);
            lanes.iter().sum::<f32>()
        })
        .sum()
}

/// `value`, unknown to the compiler.
fn opaque(value: f32) -> f32 {
    std::hint::black_box(value)
}

/// How a read variant prefetches: not at all, or each line this many bytes ahead, into L1 or
/// non-temporally.
#[derive(Clone, Copy)]
enum Prefetch {
    None,
    L1(usize),
    Nta(usize),
}

/// Read bandwidth, GB/s, of each summing loop on one thread and on two (each summing half).
fn read(gb: f64, repeats: usize) -> serde_json::Value {
    let values = vec![1f32; (gb * 1e9 / 4.0) as usize / 256 * 256];
    let bytes = (values.len() * 4) as f64;
    let half = values.len() / 2;
    let mut out = serde_json::Map::new();
    out.insert("buffer_gb".into(), (bytes / 1e9).into());
    type Sum = fn(&[f32]) -> f32;
    // AVX-512F was checked in `main`; the buffer is a multiple of 256 floats, so each half of 16 · 8.
    let variants: [(&str, Sum); 9] = [
        ("plain", plain_sum),
        ("avx512_x4", |v| unsafe { sum512::<4>(v, Prefetch::None) }),
        ("avx512_x8", |v| unsafe { sum512::<8>(v, Prefetch::None) }),
        ("avx512_x8_l1_1k", |v| unsafe {
            sum512::<8>(v, Prefetch::L1(1 << 10))
        }),
        ("avx512_x8_l1_4k", |v| unsafe {
            sum512::<8>(v, Prefetch::L1(4 << 10))
        }),
        ("avx512_x8_l1_16k", |v| unsafe {
            sum512::<8>(v, Prefetch::L1(16 << 10))
        }),
        ("avx512_x8_nta_1k", |v| unsafe {
            sum512::<8>(v, Prefetch::Nta(1 << 10))
        }),
        ("avx512_x8_nta_4k", |v| unsafe {
            sum512::<8>(v, Prefetch::Nta(4 << 10))
        }),
        ("avx512_x8_nta_16k", |v| unsafe {
            sum512::<8>(v, Prefetch::Nta(16 << 10))
        }),
    ];
    for (name, sum) in variants {
        let mut threads = serde_json::Map::new();
        for count in [1, 2] {
            let runs = on_threads(count, repeats, &|index| {
                let part = if count == 1 {
                    &values[..]
                } else {
                    &values[index * half..(index + 1) * half]
                };
                std::hint::black_box(sum(std::hint::black_box(part)));
            });
            threads.insert(format!("threads_{count}"), rates(bytes, &runs));
        }
        out.insert(name.into(), threads.into());
    }
    out.into()
}

/// The 16-sum loop a plain Rust sum becomes (the target's baseline vectors: SSE2 here).
fn plain_sum(values: &[f32]) -> f32 {
    let mut sums = [0f32; 16];
    for chunk in values.chunks_exact(16) {
        for (sum, value) in sums.iter_mut().zip(chunk) {
            *sum += value;
        }
    }
    sums.iter().sum()
}

/// A sum in `N` 16-lane accumulators, `N` vectors (`N` cache lines) a step, prefetching as asked.
///
/// # Safety
/// The CPU must have AVX-512F; `values.len()` a multiple of `16 · N`.
#[target_feature(enable = "avx512f")]
unsafe fn sum512<const N: usize>(values: &[f32], prefetch: Prefetch) -> f32 {
    use std::arch::x86_64::*;
    let mut sums = [_mm512_setzero_ps(); N];
    let step = 16 * N;
    let end = values.as_ptr_range().end as usize;
    for start in (0..values.len()).step_by(step) {
        let p = values.as_ptr().add(start);
        match prefetch {
            Prefetch::None => {}
            Prefetch::L1(ahead) | Prefetch::Nta(ahead) => {
                for line in 0..N {
                    let at = (p as usize) + ahead + line * 64;
                    // Prefetching past the buffer does not fault, but it is wasted: stop at its end.
                    if at < end {
                        match prefetch {
                            Prefetch::L1(_) => _mm_prefetch::<_MM_HINT_T0>(at as *const i8),
                            _ => _mm_prefetch::<_MM_HINT_NTA>(at as *const i8),
                        }
                    }
                }
            }
        }
        for (lane, sum) in sums.iter_mut().enumerate() {
            *sum = _mm512_add_ps(*sum, _mm512_loadu_ps(p.add(16 * lane)));
        }
    }
    sums.iter().map(|&sum| _mm512_reduce_add_ps(sum)).sum()
}

/// Decoding's product (`Ops::Fast`) on weights larger than the caches: GB of weights read per second, by
/// wall time and by the process's CPU time (candle's pool included), 1 and 8 rows of `x`.
fn products(repeats: usize) -> candle_core::Result<serde_json::Value> {
    let (n, k) = (151_936, 896);
    let layers = (0..3)
        .map(|_| Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu).map(Linear::dense))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let bytes = (layers.len() * n * k * 4) as f64;
    let mut out = serde_json::Map::new();
    out.insert(
        "threads".into(),
        candle_core::utils::get_num_threads().into(),
    );
    out.insert("weights_gb".into(), (bytes / 1e9).into());
    for rows in [1, 8] {
        let x = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu)?;
        let (mut wall, mut cpu) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..repeats + 1 {
            let (cpu_before, _) = process_clock();
            let started = Instant::now();
            for layer in &layers {
                std::hint::black_box(layer.forward(&x, Ops::Fast)?);
            }
            wall = wall.min(started.elapsed().as_secs_f64());
            cpu = cpu.min(process_clock().0 - cpu_before);
        }
        out.insert(
            format!("rows_{rows}"),
            serde_json::json!({"gb_per_wall_s": bytes / wall / 1e9, "gb_per_cpu_s": bytes / cpu / 1e9}),
        );
    }
    Ok(out.into())
}
