//! Loading a model folder holds each tensor once: an allocator that counts the bytes the loading thread
//! holds sees the peak of a load stay within a slice of the embedding matrix (the largest tensor) above
//! what the loaded model keeps. A loader that read a tensor into a buffer and then copied it into the
//! tensor peaked a whole embedding higher (issue 36).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use candle_core::{DType, Device};
use holo_model::config::Arch;
use holo_model::files::load_model;
use holo_model::init::{init_model, InitOptions, Preset};

/// The system's allocator, counting what each thread allocates and frees (a thread's count, so that
/// tests running beside it do not move it).
struct Counting;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(bytes: isize) {
    // `try_with`: a thread being torn down may still free memory after its counters are gone.
    let _ = HELD.try_with(|held| {
        let now = held.get() + bytes;
        held.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is passed to `System` unchanged; counting only reads and writes thread-local cells.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            count(layout.size() as isize);
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc_zeroed(layout) };
        if !pointer.is_null() {
            count(layout.size() as isize);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        let moved = unsafe { System.realloc(pointer, layout, size) };
        if !moved.is_null() {
            count(size as isize - layout.size() as isize);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn loading_holds_each_tensor_once() {
    let dir = std::env::temp_dir().join(format!("holo-model-load-{}", std::process::id()));
    let vocab = 65_536;
    let summary = init_model(
        &dir,
        &InitOptions {
            arch: Arch::Qwen3,
            preset: Preset::Tiny,
            seed: 0,
            force: true,
            vocab: Some(vocab),
            layers: None,
        },
    )
    .unwrap();
    // Tied: the embedding is the head too, and by far the largest tensor (16 MiB in f32).
    assert!(summary.config.tie_word_embeddings);
    let embedding = vocab * summary.config.hidden_size;
    for dtype in [DType::F32, DType::BF16] {
        HELD.with(|held| held.set(0));
        PEAK.with(|peak| peak.set(0));
        let model = load_model(&dir, dtype, &Device::Cpu).unwrap();
        let (held, peak) = (HELD.with(Cell::get), PEAK.with(Cell::get));
        let embedding_bytes = (embedding * dtype.size_in_bytes()) as isize;
        assert!(
            held >= embedding_bytes,
            "{dtype:?}: the model holds {held} bytes, less than its embedding's {embedding_bytes}"
        );
        // Reading the f32 file into bf16 holds a slice of 2^18 values in both types (1.5 MiB); the
        // old loader held the whole f32 embedding (16 MiB) beside the model.
        let transient = peak - held;
        assert!(
            transient < embedding_bytes / 2,
            "{dtype:?}: loading peaked {transient} bytes above the loaded model's {held}, \
             against an embedding of {embedding_bytes}: a tensor was held twice"
        );
        drop(model);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
