use candle_core::{DType, Device, Tensor};
use holo_model::files;
use holo_model::Ops;

#[test]
fn scratch() {
    let dir = std::path::PathBuf::from(std::env::var("Q35DIR").unwrap());
    let seqs: Vec<Vec<u32>> = [(1usize, 7usize), (6, 101), (17, 389)]
        .into_iter()
        .map(|(len, start)| {
            (0..len)
                .map(|i| ((start + 37 * i * i + 11 * i) % 512) as u32)
                .collect()
        })
        .collect();
    for (dtype, ops) in [
        (DType::F64, Ops::Differentiable),
        (DType::F32, Ops::Fast),
        (DType::F32, Ops::Differentiable),
    ] {
        let model = files::load_model(&dir, dtype, &Device::Cpu).unwrap();
        let mut all = Vec::new();
        for ids in &seqs {
            let n = ids.len();
            let input = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let mask = Tensor::ones((1, n), DType::U8, &Device::Cpu).unwrap();
            let pos = holo_model::model::positions_from_mask(&mask).unwrap();
            let h = model
                .forward_hidden(&input, &pos, &mask, None, ops)
                .unwrap();
            let l = model.logits(&h, ops).unwrap().to_dtype(DType::F64).unwrap();
            let v: Vec<Vec<f64>> = l.squeeze(0).unwrap().to_vec2().unwrap();
            all.push(v);
        }
        std::fs::write(
            format!("/tmp/w/q35/seq-{dtype:?}-{ops:?}.json"),
            serde_json::to_string(&all).unwrap(),
        )
        .unwrap();
    }
}
