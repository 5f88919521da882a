//! Decoding's products alone: `x` `[M, K]` times an f32 or bf16 weight `[N, K]` transposed, as a linear layer
//! computes it when sampling (`Ops::Fast`), at the shapes given; and, for scale, how fast one core reads
//! memory in a plain sum.
//!
//!     RAYON_NUM_THREADS=1 cargo run -p holo-model --example skinny_bench -- \
//!         [--rows 1] [--repeats 20] [--dtype f32|bf16] [--shapes 11008x4096,4096x11008,100278x4096]
//!
//! Prints one JSON object: for each shape `N`×`K` the weights' GB read per CPU second (user and system,
//! all threads; the mean of `repeats` products) and per wall second (their median), and the sum's GB per
//! CPU second over a 1.5 GB array.

use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use holo_model::model::Linear;
use holo_model::Ops;

fn main() -> ExitCode {
    holo_model::threads::settle();
    let mut args = std::env::args().skip(1);
    let (mut rows, mut repeats, mut dtype) = (1, 20, DType::F32);
    let mut shapes = vec![(11_008, 4_096), (4_096, 11_008), (100_278, 4_096)];
    while let Some(arg) = args.next() {
        let Some(value) = args.next() else {
            eprintln!("error: {arg} needs a value");
            return ExitCode::from(2);
        };
        let number = value.parse::<usize>();
        match (arg.as_str(), number) {
            ("--rows", Ok(value)) => rows = value,
            ("--repeats", Ok(value)) => repeats = value.max(1),
            ("--dtype", _) if value == "bf16" => dtype = DType::BF16,
            ("--dtype", _) if value == "f32" => dtype = DType::F32,
            ("--shapes", _) => match parse_shapes(&value) {
                Some(parsed) => shapes = parsed,
                None => {
                    eprintln!("error: --shapes takes NxK,NxK,...");
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!("error: unknown argument {arg} {value}");
                return ExitCode::from(2);
            }
        }
    }
    match run(rows, repeats, dtype, &shapes) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn parse_shapes(text: &str) -> Option<Vec<(usize, usize)>> {
    text.split(',')
        .map(|shape| {
            let (n, k) = shape.split_once('x')?;
            Some((n.parse().ok()?, k.parse().ok()?))
        })
        .collect()
}

fn run(
    rows: usize,
    repeats: usize,
    dtype: DType,
    shapes: &[(usize, usize)],
) -> candle_core::Result<String> {
    let mut products = Vec::new();
    for &(n, k) in shapes {
        let layer =
            Linear::dense(Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?.to_dtype(dtype)?);
        let x = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu)?;
        std::hint::black_box(layer.forward(&x, Ops::Fast)?);
        // CPU time is counted in ticks of 10 ms, about one product: the mean over all repeats.
        let (started, mut walls) = (cpu_seconds(), Vec::new());
        for _ in 0..repeats {
            let wall = Instant::now();
            std::hint::black_box(layer.forward(&x, Ops::Fast)?);
            walls.push(wall.elapsed().as_secs_f64());
        }
        let seconds = (cpu_seconds() - started) / repeats as f64;
        let bytes = (n * k * dtype.size_in_bytes()) as f64;
        products.push(format!(
            "{{\"n\": {n}, \"k\": {k}, \"cpu_ms\": {:.2}, \"gb_per_cpu_s\": {:.2}, \"gb_per_wall_s\": {:.2}}}",
            seconds * 1e3,
            bytes / seconds / 1e9,
            bytes / median(walls) / 1e9
        ));
    }
    Ok(format!(
        "{{\"rows\": {rows}, \"repeats\": {repeats}, \"read_gb_per_cpu_s\": {:.2}, \"products\": [{}]}}",
        read_rate(),
        products.join(", ")
    ))
}

/// GB per CPU second of one thread summing a 1.5 GB array of f32, 16 sums in flight (the median of 5).
fn read_rate() -> f64 {
    let values = vec![1f32; 3 << 27];
    let mut seconds = Vec::new();
    for _ in 0..5 {
        let started = cpu_seconds();
        let mut sums = [0f32; 16];
        for chunk in values.chunks_exact(16) {
            for (sum, value) in sums.iter_mut().zip(chunk) {
                *sum += value;
            }
        }
        std::hint::black_box(sums);
        seconds.push(cpu_seconds() - started);
    }
    (values.len() * 4) as f64 / median(seconds) / 1e9
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The process's user and system CPU seconds, all threads (Linux: `/proc/self/stat`, in clock ticks of
/// 1/100 s; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // The fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}
