//! `include_holoware!` and `holoware!`: compile a `.hol` file into a typed state machine at build time.
//!
//! Both macros run `holoc::compile`, the function `holoc check` runs, and emit the module of
//! `holoc::codegen`. Errors become `compile_error!`s spanned at the path (or source) literal, each
//! rendered as rustc renders its own, `--> file.hol:LINE:COL` and an excerpt included; a skeleton module
//! is emitted beside them so that code using the module adds no errors of its own.
//!
//! ```ignore
//! // Expands to `pub mod tool { pub struct Input, Vars, Machine, ... }`; holotypes named in the file
//! // resolve in this scope (or under `holotypes = path`).
//! holo_macros::include_holoware!("hol/tool.hol");
//! holo_macros::include_holoware!(agent, "hol/tool.hol", holotypes = crate::tools);
//! holo_macros::holoware!(qa, r#"<|o_o|><|question|><|@_@:answer|>"#);
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use holoc::codegen::{self, Settings};
use holoc::scan::{self, CrateScan};
use holoc::Options;
use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::{Ident, LitStr, Token};

/// `[module ,] "literal" [, holotypes = path] [,]`
struct MacroInput {
    module: Option<Ident>,
    literal: LitStr,
    holotypes: Option<syn::Path>,
}

impl Parse for MacroInput {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let module = if input.peek(Ident) && input.peek2(Token![,]) {
            let module: Ident = input.parse()?;
            input.parse::<Token![,]>()?;
            Some(module)
        } else {
            None
        };
        let literal: LitStr = input.parse()?;
        let mut holotypes = None;
        while input.parse::<Option<Token![,]>>()?.is_some() {
            if input.is_empty() {
                break;
            }
            let key: Ident = input.parse()?;
            if key != "holotypes" {
                return Err(syn::Error::new(
                    key.span(),
                    format!(
                        "unknown option `{key}`; the only option is `holotypes = path::to::module`"
                    ),
                ));
            }
            input.parse::<Token![=]>()?;
            holotypes = Some(input.parse()?);
        }
        if !input.is_empty() {
            return Err(input.error("expected `, holotypes = path` or the end of the macro input"));
        }
        Ok(MacroInput {
            module,
            literal,
            holotypes,
        })
    }
}

/// Compiles the `.hol` file at a path relative to the crate root (`CARGO_MANIFEST_DIR`) into a module
/// named after the file (or the name given first).
#[proc_macro]
pub fn include_holoware(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = syn::parse_macro_input!(input as MacroInput);
    expand_file(input).into()
}

/// Compiles inline Holoware source into a module named `holoware` (or the name given first).
#[proc_macro]
pub fn holoware(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = syn::parse_macro_input!(input as MacroInput);
    let module = input
        .module
        .clone()
        .unwrap_or_else(|| Ident::new("holoware", Span::call_site()));
    let root = manifest_dir();
    let source = input.literal.value();
    let display_name = format!("{module}.hol (inline)");
    let settings = settings(&input, module, display_name, None);
    expand(source.as_bytes(), &settings, root.as_deref(), None).into()
}

/// The folder `.hol` paths are relative to, and whose crate is scanned for holotypes:
/// `HOLOWARE_MANIFEST_DIR` when set (for test harnesses such as trybuild, which build copies of a crate
/// elsewhere), else `CARGO_MANIFEST_DIR`.
fn manifest_dir() -> Option<PathBuf> {
    std::env::var_os("HOLOWARE_MANIFEST_DIR")
        .or_else(|| std::env::var_os("CARGO_MANIFEST_DIR"))
        .map(PathBuf::from)
}

fn settings(
    input: &MacroInput,
    module: Ident,
    display_name: String,
    track: Option<String>,
) -> Settings {
    let mut settings = Settings::new(module, display_name);
    settings.track_path = track;
    settings.holotypes = input.holotypes.as_ref().map(|path| quote!(#path));
    settings.span = input.literal.span();
    settings
}

fn expand_file(input: MacroInput) -> TokenStream {
    let span = input.literal.span();
    let written = input.literal.value();
    let Some(root) = manifest_dir() else {
        return error(
            span,
            "CARGO_MANIFEST_DIR is not set: include_holoware! must be built by cargo",
        );
    };
    if Path::new(&written).is_absolute() {
        return error(
            span,
            &format!(
                "include_holoware! takes a path relative to the crate root, not the absolute path `{written}`\n\
                 help: write it relative to {}",
                root.display()
            ),
        );
    }
    let path = root.join(&written);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(io_error) => {
            return error(
                span,
                &format!(
                    "cannot read `{written}`: {io_error}\n looked for: {}\n (paths are relative to the crate root, CARGO_MANIFEST_DIR)",
                    path.display()
                ),
            )
        }
    };
    let module = input.module.clone().unwrap_or_else(|| {
        let stem = Path::new(&written)
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut module = codegen::module_name(&stem);
        module.set_span(Span::call_site());
        module
    });
    let track = path.to_string_lossy().into_owned();
    let settings = settings(&input, module, written, Some(track));
    expand(&bytes, &settings, Some(&root), Some(&path))
}

/// Runs the compiler and emits the module, or the errors beside a skeleton. `file` is where the bytes
/// were read, whose folder a `json_schema_file` path is relative to.
fn expand(
    bytes: &[u8],
    settings: &Settings,
    root: Option<&Path>,
    file: Option<&Path>,
) -> TokenStream {
    // Holotypes under a path outside this crate (`holotypes = other_crate`) are beyond the scan: rustc
    // resolves them.
    let local = settings.holotypes.as_ref().is_none_or(|path| {
        let first = path
            .clone()
            .into_iter()
            .next()
            .map(|token| token.to_string());
        matches!(first.as_deref(), Some("crate" | "self" | "super"))
    });
    let options = if local {
        Options::with_builtins(root.map(cached_scan))
    } else {
        // The path decides every holotype name, built-in names included.
        Options::default()
    };
    let options = match file {
        Some(file) => options.for_file(file),
        None => options,
    };
    let output = holoc::compile(bytes, &options);
    let Some(program) = output.program.as_ref() else {
        let source = holoc::report::SourceFile::new(&settings.display_name, &output.source);
        let errors = output
            .diagnostics
            .iter()
            .filter(|diagnostic| diagnostic.is_error())
            .map(|diagnostic| {
                // compile_error! prints `error: ` itself: `error[H0021]: ...` becomes `error: H0021: ...`.
                let rendered = source.plain(diagnostic).trim_end().to_string();
                let message = rendered
                    .strip_prefix("error[")
                    .and_then(|rest| rest.split_once("]: "))
                    .map_or(rendered.clone(), |(code, rest)| format!("{code}: {rest}"));
                quote_spanned!(settings.span=> ::core::compile_error!(#message);)
            });
        let skeleton = codegen::skeleton(settings);
        let track = settings.track_path.as_ref().map(|path| {
            quote!(
                const _: &[u8] = ::core::include_bytes!(#path);
            )
        });
        return quote! {
            #(#errors)*
            #track
            #skeleton
        };
    };
    // The schema files the program holds, watched as the `.hol` file is (an absolute path: the source's
    // folder joined with the argument).
    let read = program.read.iter().map(|file| {
        let file = file.to_string_lossy();
        quote!(
            const _: &[u8] = ::core::include_bytes!(#file);
        )
    });
    let module = codegen::module(program, settings);
    quote! {
        #module
        #(#read)*
    }
}

/// The scan of a crate, done once per crate in this compiler process.
fn cached_scan(root: &Path) -> CrateScan {
    static SCANS: OnceLock<Mutex<HashMap<PathBuf, CrateScan>>> = OnceLock::new();
    let mut scans = SCANS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    scans
        .entry(root.to_path_buf())
        .or_insert_with(|| scan::scan_crate(root))
        .clone()
}

fn error(span: Span, message: &str) -> TokenStream {
    quote_spanned!(span=> ::core::compile_error!(#message);)
}
