//! A chat request's own template arguments (`SampleParams::chat_template_kwargs`, what a context's
//! `<|+++ enable_thinking=false|>` gives a sampler of chat messages) in the local model's rendering.

use holo_runtime::local::{LocalModel, LocalOptions};
use holo_runtime::sampler::{ChatMessage, Prompt, Request, SampleParams, SamplerError};
use holo_runtime::Role;
use serde_json::json;

use crate::common::fixtures;
use crate::common::tempdir::Dir;

/// The committed Qwen3 fixture with Qwen3's real chat template (which reads `enable_thinking`).
fn qwen3_with_its_template() -> (Dir, LocalModel) {
    let dir = Dir::new("local-template-kwargs");
    let model = fixtures().join("models/qwen3");
    for file in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(model.join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(
        fixtures().join("chat/models/qwen3/tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let sampler = LocalModel::load(dir.path(), LocalOptions::default()).unwrap();
    (dir, sampler)
}

#[test]
fn a_chat_requests_template_arguments_render_its_prompt() {
    let (_dir, model) = qwen3_with_its_template();
    let chat = Prompt::Chat(vec![ChatMessage {
        role: Role::User,
        content: "What is 2+2?".into(),
    }]);
    let without_thinking = |prompt: Prompt| Request {
        prompt,
        params: SampleParams {
            chat_template_kwargs: json!({"enable_thinking": false}).as_object().cloned(),
            ..SampleParams::default()
        },
    };
    let plain = model.prompt_ids(&chat).unwrap();
    let ids = model.request_ids(&without_thinking(chat.clone())).unwrap();
    let text = model.tokenizer().decode(&ids, false).unwrap();
    // Qwen3's generation prompt without thinking: the empty think block after the plain one.
    assert!(text.ends_with("<think>\n\n</think>\n\n"), "{text:?}");
    assert_eq!(ids[..plain.len()], plain[..]);
    assert!(ids.len() > plain.len());
    // A text prompt is rendered already: its arguments are refused, never dropped.
    let refused = model.request_ids(&without_thinking(Prompt::Text("What is 2+2?".into())));
    assert!(
        matches!(&refused, Err(SamplerError::Rejected(message)) if message.contains("chat prompts only")),
        "{refused:?}"
    );
}
