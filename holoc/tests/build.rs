//! `holoc::build::compile_dir`, the build-script step.

mod scratch;
use scratch::Scratch;

fn scratch(name: &str) -> Scratch {
    let dir = Scratch::new("build", name);
    std::fs::create_dir_all(dir.join("hol/nested")).unwrap();
    dir
}

#[test]
fn writes_one_module_per_file() {
    let root = scratch("ok");
    std::fs::write(
        root.join("hol/qa.hol"),
        "<|o_o|>\n<|question|>\n<|@_@:answer|>\n",
    )
    .unwrap();
    std::fs::write(
        root.join("hol/nested/my-env.hol"),
        "<|o_o|>\nHi\n<|@_@:reply|>\n",
    )
    .unwrap();
    let out = root.join("out");
    let generated = holoc::build::compile_dir(&root, "hol".as_ref(), &out).unwrap();
    let modules: Vec<&str> = generated.iter().map(|file| file.module.as_str()).collect();
    assert_eq!(modules, ["my_env", "qa"]);
    let code = std::fs::read_to_string(out.join("qa.rs")).unwrap();
    assert!(code.contains("pub mod qa {"), "{code}");
    assert!(
        code.contains("pub question: ::holo_runtime::Text"),
        "{code}"
    );
    syn::parse_file(&code).expect("the generated file is valid Rust");
}

/// A schema read from a file beside the source is in the generated module, and listed as read, for
/// cargo to rerun the build when it changes.
#[test]
fn a_schema_file_is_embedded_and_watched() {
    let root = scratch("schema");
    std::fs::write(
        root.join("hol/plan.hol"),
        "<|o_o|>\nPlan.\n<|@_@:plan json_schema_file=\"schemas/plan.json\"|>\n",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("hol/schemas")).unwrap();
    std::fs::write(
        root.join("hol/schemas/plan.json"),
        r#"{"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}}"#,
    )
    .unwrap();
    let out = root.join("out");
    let generated = holoc::build::compile_dir(&root, "hol".as_ref(), &out).unwrap();
    assert_eq!(generated[0].read, [root.join("hol/schemas/plan.json")]);
    let code = std::fs::read_to_string(out.join("plan.rs")).unwrap();
    assert!(code.contains("json_schema("), "{code}");
    assert!(code.contains("Lima"), "{code}");
}

#[test]
fn reports_every_failing_file() {
    let root = scratch("err");
    std::fs::write(
        root.join("hol/a.hol"),
        "<|o_o|>\n<|answer|>\n<|@_@:answer|>\n",
    )
    .unwrap();
    std::fs::write(root.join("hol/b.hol"), "<|@_@ temprature=1|>\n").unwrap();
    let error = holoc::build::compile_dir(&root, "hol".as_ref(), &root.join("out")).unwrap_err();
    assert!(
        error.message.contains("--> hol/a.hol:2:3"),
        "{}",
        error.message
    );
    assert!(
        error.message.contains("--> hol/b.hol:1:7"),
        "{}",
        error.message
    );
}

#[test]
fn missing_folder_is_an_error() {
    let root = scratch("missing");
    let error = holoc::build::compile_dir(&root, "nope".as_ref(), &root.join("out")).unwrap_err();
    assert!(error.message.contains("cannot read"), "{}", error.message);
}
