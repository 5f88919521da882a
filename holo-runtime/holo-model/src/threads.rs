//! How many threads candle runs on, decided once per process.
//!
//! candle asks for its thread count at every matrix product it computes
//! (`candle_core::utils::get_num_threads`). Unless `RAYON_NUM_THREADS` or `CANDLE_NUM_THREADS` is set,
//! each call counts the physical cores by reading and parsing `/proc/cpuinfo`, and attention computes two
//! such products per layer at every decoding step: SmolLM2-135M decoded one sequence at 65 tokens/s
//! without the variable and 90–93 with it (`sample_bench`, 2 cores). [`settle`] sets the variable to the
//! count candle would have found, so nothing else changes.

/// Sets `RAYON_NUM_THREADS` to candle's own thread count when neither it nor `CANDLE_NUM_THREADS` is
/// set (see the module's documentation). Call it first thing in `main`, before any other thread runs:
/// changing the environment while another thread reads it is undefined behaviour in C.
pub fn settle() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none()
        && std::env::var_os("CANDLE_NUM_THREADS").is_none()
    {
        let count = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", count.to_string());
    }
}
