//! The crate scan: finds the holotypes a Rust crate defines (`impl Holotype for T`, with `const PARAMS`)
//! and the other type names it declares or imports, so `holoc check` and `include_holoware!` can report
//! an unknown holotype or argument at its `.hol` line with a suggestion.
//!
//! The scan reads source text with syn and never runs code; rustc remains the final judge. Where the scan
//! cannot be sure (a name imported by a glob from another crate), it defers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A holotype the scan found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolotypeDecl {
    /// The keyword parameters from `const PARAMS: &[&str] = &[...]`; `None` when not written as literals.
    pub params: Option<Vec<String>>,
    pub file: PathBuf,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CrateScan {
    pub root: PathBuf,
    pub holotypes: BTreeMap<String, HolotypeDecl>,
    /// Structs, enums, unions and type aliases declared in the crate.
    pub types: BTreeSet<String>,
    /// Names brought into scope by `use` (the alias when renamed).
    pub imports: BTreeSet<String>,
    /// Identifiers passed to item macros other than ours, which may expand to holotype impls.
    pub macro_idents: BTreeSet<String>,
    /// Whether names may come from where the scan cannot see: a glob import from another crate.
    pub opaque: bool,
}

/// What the scan can say about a holotype name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution<'a> {
    Holotype(&'a HolotypeDecl),
    /// Declared in the crate without an `impl Holotype`.
    NotAHolotype,
    /// Found nowhere, and nothing the scan cannot see could provide it.
    Unknown,
    /// Imported, or possibly brought in by an external glob: only rustc can tell.
    Undecided,
}

/// Crates whose glob imports the scan understands: their holotypes are listed in the checker's options.
const KNOWN_CRATES: [&str; 1] = ["holo_runtime"];

impl CrateScan {
    pub fn resolve(&self, name: &str) -> Resolution<'_> {
        if let Some(decl) = self.holotypes.get(name) {
            Resolution::Holotype(decl)
        } else if self.imports.contains(name) || self.macro_idents.contains(name) || self.opaque {
            Resolution::Undecided
        } else if self.types.contains(name) {
            Resolution::NotAHolotype
        } else {
            Resolution::Unknown
        }
    }
}

/// The root of the crate that contains `path`: the nearest ancestor folder whose `Cargo.toml` declares a
/// package. `None` when the nearest manifest is a virtual workspace manifest, or there is none.
pub fn crate_root(path: &Path) -> Option<PathBuf> {
    let start = if path.is_dir() { path } else { path.parent()? };
    let start = start.canonicalize().ok()?;
    let root = start
        .ancestors()
        .find(|dir| dir.join("Cargo.toml").is_file())?;
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).ok()?;
    manifest
        .lines()
        .any(|line| line.trim() == "[package]")
        .then(|| root.to_path_buf())
}

/// Scans the Rust sources of the crate at `root`: `build.rs` and everything under `src/`, `examples/`,
/// `tests/` and `benches/`. Files that do not parse are skipped.
pub fn scan_crate(root: &Path) -> CrateScan {
    let mut scan = CrateScan {
        root: root.to_path_buf(),
        ..CrateScan::default()
    };
    let mut files = Vec::new();
    if root.join("build.rs").is_file() {
        files.push(root.join("build.rs"));
    }
    for dir in ["src", "examples", "tests", "benches"] {
        collect_rust_files(&root.join(dir), &mut files);
    }
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let Ok(syntax) = syn::parse_file(&text) else {
            continue;
        };
        let mut visitor = Visitor {
            scan: &mut scan,
            file: &file,
        };
        visitor.visit_file(&syntax);
    }
    scan
}

/// The `.rs` files under `dir`, in name order. Symbolic links to folders are not followed: a link back
/// up would loop until the stack overflows.
fn collect_rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(|entry| entry.file_name());
    for entry in entries {
        let path = entry.path();
        if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            collect_rust_files(&path, files);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            files.push(path);
        }
    }
}

struct Visitor<'a> {
    scan: &'a mut CrateScan,
    file: &'a Path,
}

impl<'ast> Visit<'ast> for Visitor<'_> {
    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        let implements_holotype = item
            .trait_
            .as_ref()
            .and_then(|(_, path, _)| path.segments.last())
            .is_some_and(|segment| segment.ident == "Holotype");
        if let (true, syn::Type::Path(self_type)) = (implements_holotype, &*item.self_ty) {
            if let Some(segment) = self_type.path.segments.last() {
                let params = item.items.iter().find_map(|impl_item| match impl_item {
                    syn::ImplItem::Const(constant) if constant.ident == "PARAMS" => {
                        Some(string_literals(&constant.expr))
                    }
                    _ => None,
                });
                self.scan.holotypes.insert(
                    segment.ident.to_string(),
                    HolotypeDecl {
                        params: params.flatten(),
                        file: self.file.to_path_buf(),
                    },
                );
            }
        }
        syn::visit::visit_item_impl(self, item);
    }

    fn visit_item_struct(&mut self, item: &'ast syn::ItemStruct) {
        self.scan.types.insert(item.ident.to_string());
        syn::visit::visit_item_struct(self, item);
    }

    fn visit_item_enum(&mut self, item: &'ast syn::ItemEnum) {
        self.scan.types.insert(item.ident.to_string());
        syn::visit::visit_item_enum(self, item);
    }

    fn visit_item_union(&mut self, item: &'ast syn::ItemUnion) {
        self.scan.types.insert(item.ident.to_string());
        syn::visit::visit_item_union(self, item);
    }

    fn visit_item_type(&mut self, item: &'ast syn::ItemType) {
        self.scan.types.insert(item.ident.to_string());
        syn::visit::visit_item_type(self, item);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let leading = item.leading_colon.is_some();
        self.use_tree(&item.tree, &mut Vec::new(), leading);
    }

    fn visit_item_macro(&mut self, item: &'ast syn::ItemMacro) {
        // An item macro other than ours could expand to a holotype impl the scan cannot see.
        let ours = item.mac.path.segments.last().is_some_and(|segment| {
            segment.ident == "holoware" || segment.ident == "include_holoware"
        });
        if item.ident.is_none() && !ours {
            collect_idents(item.mac.tokens.clone(), &mut self.scan.macro_idents);
        }
        syn::visit::visit_item_macro(self, item);
    }
}

impl Visitor<'_> {
    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>, leading_colon: bool) {
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(&path.tree, prefix, leading_colon);
                prefix.pop();
            }
            syn::UseTree::Name(name) => {
                self.scan.imports.insert(name.ident.to_string());
            }
            syn::UseTree::Rename(rename) => {
                self.scan.imports.insert(rename.rename.to_string());
            }
            syn::UseTree::Glob(_) => {
                let first = prefix.first().map(String::as_str);
                let local = !leading_colon && matches!(first, Some("crate" | "self" | "super"));
                let known = first.is_some_and(|krate| KNOWN_CRATES.contains(&krate));
                if !local && !known {
                    self.scan.opaque = true;
                }
            }
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(tree, prefix, leading_colon);
                }
            }
        }
    }
}

/// The string literals of `&["a", "b"]` or `["a", "b"]`; `None` if it is anything else.
fn string_literals(expr: &syn::Expr) -> Option<Vec<String>> {
    match expr {
        syn::Expr::Reference(reference) => string_literals(&reference.expr),
        syn::Expr::Array(array) => array
            .elems
            .iter()
            .map(|elem| match elem {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(text),
                    ..
                }) => Some(text.value()),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

fn collect_idents(tokens: proc_macro2::TokenStream, idents: &mut BTreeSet<String>) {
    for token in tokens {
        match token {
            proc_macro2::TokenTree::Ident(ident) => {
                idents.insert(ident.to_string());
            }
            proc_macro2::TokenTree::Group(group) => collect_idents(group.stream(), idents),
            _ => {}
        }
    }
}
