//! The scanner for "layers compute through device ops": every place in a crate's source that
//! reads or writes a tensor's elements in host memory behind its device's back.
//!
//! A host read is one of three things, found by path, not by grep:
//! - a `Tensor` method that hands out host elements ([`TENSOR_HOST_ACCESSORS`]), called as a
//!   method (`.as_f32()`) or by path (`Tensor::to_vec_f32`);
//! - anything of `conveyor_engine::cpu` (the CPU kernels, which take host slices) but the types
//!   that only describe shapes ([`CPU_DESCRIPTIONS`]), reached through `use` (renames, nested
//!   braces, `self`, aliases of the engine crate) or written in full; a glob import or a `pub use`
//!   of the kernels is a host read where it stands, since it hides the calls;
//! - a call of a free function of the scanned crate that itself holds a host read (a helper such
//!   as `tensor_io::values`), followed through `use`, `crate::`, `super::` and `self::` paths and
//!   transitively. Methods are not followed (their receiver's type is unknown to a scan): a host
//!   read inside a method is reported where it stands.
//!
//! Comments, string literals and `#[cfg(test)]` items are blanked first (`scan::lex`); callers
//! drop the files of out-of-line test modules (`scan::without_test_files`). Each read names the
//! function it sits in (`Type::method` or the free function's name), so an allow-list can name
//! exact places.
use std::collections::BTreeSet;

use super::scan::{
    Ident, Lexed, SourceFile, Violation, identifiers, in_use_declaration, lex, matching_brace, text_before,
};

/// `Tensor` methods that read or write the elements in host memory, and what each does.
pub const TENSOR_HOST_ACCESSORS: [(&str, &str); 7] = [
    ("as_f32", "borrows the elements in host memory (`Error::NotOnHost` on a GPU)"),
    ("as_f32_mut", "borrows the elements in host memory to write them (`Error::NotOnHost` on a GPU)"),
    ("from_f32_init", "fills a new tensor's elements in host memory (`Error::NotOnHost` on a GPU)"),
    ("to_vec_f32", "copies the elements into host memory (a download from a GPU)"),
    ("try_to_vec_f32", "copies the elements into host memory (a download from a GPU)"),
    ("to_le_bytes", "copies the elements' bytes into host memory (a download from a GPU)"),
    ("try_to_le_bytes", "copies the elements' bytes into host memory (a download from a GPU)"),
];

/// Items of `conveyor_engine::cpu` that describe shapes and read no elements.
pub const CPU_DESCRIPTIONS: [&str; 2] = ["Window2d", "AttentionDims"];

const ENGINE: &str = "conveyor_engine";

/// One host read: where, in which function, through what, and why that reads host memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRead {
    pub path: String,
    pub line: usize,
    /// `Type::method`, a free function's name, `outer::inner` for a nested function, or
    /// `<top level>` outside any function (a `use`).
    pub item: String,
    /// `as_f32` (a `Tensor` method), `cpu::packed::pack_rhs` (an engine CPU kernel, from `cpu::`),
    /// or `tensor_io::values` (a helper of the scanned crate, from its root).
    pub accessor: String,
    pub why: String,
    /// The line, trimmed.
    pub text: String,
}

impl HostRead {
    pub fn violation(&self, advice: &str) -> Violation {
        Violation {
            path: self.path.clone(),
            line: self.line,
            text: self.text.clone(),
            why: format!("`{}` in `{}` {}; {advice}", self.accessor, self.item, self.why),
        }
    }
}

/// Every host read in `files`, the source of one crate whose root is `src_dir` (`layers/src`).
pub fn host_reads(files: &[SourceFile], src_dir: &str) -> Vec<HostRead> {
    let parsed: Vec<Parsed> = files.iter().map(|f| Parsed::new(f, src_dir)).collect();
    let modules: BTreeSet<Vec<String>> = parsed.iter().map(|p| p.module.clone()).collect();
    let free_functions: BTreeSet<Vec<String>> = parsed
        .iter()
        .flat_map(|p| p.functions.iter().filter(|f| f.module_level).map(|f| absolute(&p.module, &f.name)))
        .collect();
    // Helpers: free functions holding a host read, grown to a fixed point (a helper's caller is one).
    let mut helpers: BTreeSet<Vec<String>> = BTreeSet::new();
    loop {
        let reads: Vec<HostRead> = parsed
            .iter()
            .flat_map(|p| {
                let context = Context { parsed: p, modules: &modules, free_functions: &free_functions };
                context.reads(&helpers)
            })
            .collect();
        let mut found = helpers.clone();
        for p in &parsed {
            for function in p.functions.iter().filter(|f| f.module_level) {
                let nested = format!("{}::", function.name);
                if reads
                    .iter()
                    .any(|r| r.path == p.file.path && (r.item == function.name || r.item.starts_with(&nested)))
                {
                    found.insert(absolute(&p.module, &function.name));
                }
            }
        }
        if found == helpers {
            return reads;
        }
        helpers = found;
    }
}

/// The body of the function `item` (as [`HostRead::item`] names it) in `file`, comments blanked,
/// strings kept: for checks that an allowed function still holds its guard.
pub fn function_body(file: &SourceFile, item: &str) -> Option<String> {
    let lexed = lex(&file.text);
    let idents = identifiers(&lexed.code);
    let function = functions(&lexed, &idents).into_iter().find(|f| f.item == item)?;
    Some(lexed.code_with_strings[function.open..=function.close].iter().collect())
}

fn absolute(module: &[String], name: &str) -> Vec<String> {
    let mut path = vec!["crate".to_string()];
    path.extend(module.iter().cloned());
    path.push(name.to_string());
    path
}

/// The module path of a file under `src_dir`: `lib.rs` is the root, `a/mod.rs` and `a.rs` are `a`.
fn module_of(path: &str, src_dir: &str) -> Vec<String> {
    let relative = path.strip_prefix(src_dir).unwrap_or(path).trim_start_matches('/').trim_end_matches(".rs");
    let mut segments: Vec<String> = relative.split('/').map(str::to_string).collect();
    if segments.last().is_some_and(|s| s == "mod" || s == "lib" || s == "main") {
        segments.pop();
    }
    segments
}

/// A function: its name, the item name reads in it carry, its body `{ .. }`, and whether it is a
/// free function of the module (not in an `impl`, a `trait` or another function).
struct Function {
    name: String,
    item: String,
    open: usize,
    close: usize,
    module_level: bool,
}

/// `impl` and `trait` blocks: the type or trait name and the braces.
fn blocks(lexed: &Lexed, idents: &[Ident]) -> Vec<(String, usize, usize)> {
    let code = &lexed.code;
    let mut out = Vec::new();
    for (k, ident) in idents.iter().enumerate() {
        let is_impl_item = ident.text == "impl"
            && (matches!(text_before(code, ident.pos, 1).as_str(), "" | "}" | ";" | "{" | "]")
                || k > 0 && idents[k - 1].text == "unsafe");
        if !is_impl_item && ident.text != "trait" {
            continue;
        }
        let start = ident.pos + ident.text.len();
        let Some(open) = first_at_depth_zero(code, start, '{') else { continue };
        let Some(close) = matching_brace(code, open) else { continue };
        let header: String = code[start..open].iter().collect();
        let name = if ident.text == "trait" { header.trim().to_string() } else { impl_type(&header) };
        let name: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        out.push((name, open, close));
    }
    out
}

/// The type an `impl` header names: `<T> Trait<X> for path::Type<T> where ..` gives `Type`.
fn impl_type(header: &str) -> String {
    let mut depth = 0i32;
    let mut plain = String::new();
    let chars: Vec<char> = header.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        match c {
            '<' => depth += 1,
            '>' if i > 0 && chars[i - 1] == '-' => {}
            '>' => depth -= 1,
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    let words: Vec<&str> = plain.split_whitespace().take_while(|w| *w != "where").collect();
    let after_for = words.iter().position(|w| *w == "for").map_or(&words[..], |p| &words[p + 1..]);
    after_for
        .first()
        .map(|w| w.rsplit("::").next().unwrap_or(w))
        .unwrap_or("")
        .trim_start_matches(['&', '*'])
        .to_string()
}

/// The first `target` after `start` outside parentheses and brackets, unless a `;` comes first.
fn first_at_depth_zero(code: &[char], start: usize, target: char) -> Option<usize> {
    let mut depth = 0i64;
    for (k, &c) in code.iter().enumerate().skip(start) {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ';' if depth == 0 => return None,
            c if c == target && depth == 0 => return Some(k),
            _ => {}
        }
    }
    None
}

fn functions(lexed: &Lexed, idents: &[Ident]) -> Vec<Function> {
    let code = &lexed.code;
    let blocks = blocks(lexed, idents);
    let mut spans: Vec<(String, usize, usize, usize)> = Vec::new(); // name, fn position, open, close
    for (k, ident) in idents.iter().enumerate() {
        if ident.text != "fn" {
            continue;
        }
        // `fn name`, not the type `fn(..)`.
        let Some(name) = idents.get(k + 1) else { continue };
        if !code[ident.pos + 2..name.pos].iter().all(|c| c.is_whitespace()) {
            continue;
        }
        let Some(open) = first_at_depth_zero(code, name.pos, '{') else { continue };
        let Some(close) = matching_brace(code, open) else { continue };
        spans.push((name.text.clone(), ident.pos, open, close));
    }
    let mut out = Vec::new();
    for (name, at, open, close) in &spans {
        let outer =
            spans.iter().filter(|(_, other_at, o, c)| other_at != at && o < at && at < c).max_by_key(|(_, _, o, _)| *o);
        let block = blocks.iter().filter(|(_, o, c)| o < at && at < c).max_by_key(|(_, o, _)| *o);
        let (item, module_level) = match (outer, block) {
            (Some((outer_name, _, outer_open, _)), block) => {
                let outer_item = match block.filter(|(_, o, _)| o < outer_open) {
                    Some((type_name, _, _)) => format!("{type_name}::{outer_name}"),
                    None => outer_name.clone(),
                };
                (format!("{outer_item}::{name}"), false)
            }
            (None, Some((type_name, _, _))) => (format!("{type_name}::{name}"), false),
            (None, None) => (name.clone(), true),
        };
        out.push(Function { name: name.clone(), item, open: *open, close: *close, module_level });
    }
    out
}

/// One `use` binding: the name it brings into scope and the path it names (resolved), or a glob.
struct Binding {
    name: String,
    path: Vec<String>,
    glob: bool,
    public: bool,
    line: usize,
}

/// The tokens of a `use` tree: words, `::`, braces, commas and `*`.
fn use_tokens(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
            continue;
        }
        if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push("::".to_string());
            i += 2;
            continue;
        }
        if matches!(c, '{' | '}' | ',' | '*') {
            out.push(c.to_string());
        }
        i += 1;
    }
    out
}

/// Parses one use tree at `tokens[*i..]` under `prefix`, pushing (name, path, glob).
fn parse_use_tree(tokens: &[String], i: &mut usize, prefix: Vec<String>, out: &mut Vec<(String, Vec<String>, bool)>) {
    let mut path = prefix;
    while let Some(token) = tokens.get(*i) {
        match token.as_str() {
            "{" => {
                *i += 1;
                while *i < tokens.len() && tokens[*i] != "}" {
                    parse_use_tree(tokens, i, path.clone(), out);
                    if tokens.get(*i).is_some_and(|t| t == ",") {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            "*" => {
                *i += 1;
                out.push(("*".to_string(), path, true));
                return;
            }
            "::" => *i += 1,
            "," | "}" => return,
            word => {
                path.push(word.to_string());
                *i += 1;
                if tokens.get(*i).is_some_and(|t| t == "::") {
                    continue;
                }
                let mut name = word.to_string();
                if tokens.get(*i).is_some_and(|t| t == "as") {
                    name = tokens.get(*i + 1).cloned().unwrap_or_default();
                    *i += 2;
                }
                if word == "self" {
                    path.pop();
                    if name == "self" {
                        name = path.last().cloned().unwrap_or_default();
                    }
                }
                out.push((name, path, false));
                return;
            }
        }
    }
}

/// A file lexed, with its module, functions and raw (unresolved) `use` bindings.
struct Parsed<'a> {
    file: &'a SourceFile,
    module: Vec<String>,
    lexed: Lexed,
    idents: Vec<Ident>,
    functions: Vec<Function>,
    uses: Vec<(String, Vec<String>, bool, bool, usize)>, // name, path, glob, public, line
}

impl<'a> Parsed<'a> {
    fn new(file: &'a SourceFile, src_dir: &str) -> Parsed<'a> {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        let functions = functions(&lexed, &idents);
        let mut uses = Vec::new();
        for ident in idents.iter().filter(|i| i.text == "use") {
            let end = (ident.pos..lexed.code.len()).find(|&p| lexed.code[p] == ';').unwrap_or(lexed.code.len());
            let tree: String = lexed.code[ident.pos + 3..end].iter().collect();
            let before = text_before(&lexed.code, ident.pos, 12);
            let public = before.ends_with("pub") || (before.ends_with(')') && before.contains("pub("));
            let mut parsed = Vec::new();
            parse_use_tree(&use_tokens(&tree), &mut 0, Vec::new(), &mut parsed);
            uses.extend(parsed.into_iter().map(|(name, path, glob)| (name, path, glob, public, ident.line)));
        }
        Parsed { file, module: module_of(&file.path, src_dir), lexed, idents, functions, uses }
    }

    /// The item a position sits in: the innermost function around it.
    fn item_at(&self, pos: usize) -> String {
        self.functions
            .iter()
            .filter(|f| f.open < pos && pos < f.close)
            .max_by_key(|f| f.open)
            .map_or_else(|| "<top level>".to_string(), |f| f.item.clone())
    }
}

/// What resolving names in one file needs: the file and the crate's modules and free functions.
struct Context<'a> {
    parsed: &'a Parsed<'a>,
    modules: &'a BTreeSet<Vec<String>>,
    free_functions: &'a BTreeSet<Vec<String>>,
}

impl Context<'_> {
    /// A path as written in a `use` (no bindings apply): `crate::`, `self::`, `super::`, a child
    /// module, or another crate (left as written).
    fn resolve_use_path(&self, segments: &[String]) -> Vec<String> {
        let module = &self.parsed.module;
        let Some(first) = segments.first() else { return Vec::new() };
        match first.as_str() {
            "crate" => segments.to_vec(),
            "self" => [vec!["crate".to_string()], module.clone(), segments[1..].to_vec()].concat(),
            "super" => {
                let n_super = segments.iter().take_while(|s| *s == "super").count();
                let parent = module[..module.len().saturating_sub(n_super)].to_vec();
                [vec!["crate".to_string()], parent, segments[n_super..].to_vec()].concat()
            }
            _ if self.modules.contains(&[module.clone(), vec![first.clone()]].concat()) => {
                [vec!["crate".to_string()], module.clone(), segments.to_vec()].concat()
            }
            _ => segments.to_vec(),
        }
    }

    fn bindings(&self) -> Vec<Binding> {
        self.parsed
            .uses
            .iter()
            .map(|(name, path, glob, public, line)| Binding {
                name: name.clone(),
                path: self.resolve_use_path(path),
                glob: *glob,
                public: *public,
                line: *line,
            })
            .collect()
    }

    /// A path as written in code: through this file's `use` bindings, then as a `use` path; a bare
    /// name of a free function of this module (or of a glob-imported one) is that function.
    fn resolve(&self, segments: &[String], bindings: &[Binding]) -> Vec<String> {
        let first = &segments[0];
        if !matches!(first.as_str(), "crate" | "self" | "super")
            && let Some(binding) = bindings.iter().find(|b| !b.glob && b.name == *first)
        {
            return [binding.path.clone(), segments[1..].to_vec()].concat();
        }
        let resolved = self.resolve_use_path(segments);
        if resolved != segments || segments.len() > 1 {
            return resolved;
        }
        let own = absolute(&self.parsed.module, first);
        if self.free_functions.contains(&own) {
            return own;
        }
        for glob in bindings.iter().filter(|b| b.glob) {
            let candidate = [glob.path.clone(), vec![first.clone()]].concat();
            if self.free_functions.contains(&candidate) {
                return candidate;
            }
        }
        resolved
    }

    fn read(&self, line: usize, item: String, accessor: String, why: &str) -> HostRead {
        HostRead {
            path: self.parsed.file.path.clone(),
            line,
            item,
            accessor,
            why: why.to_string(),
            text: self.parsed.file.line_text(line).to_string(),
        }
    }

    fn reads(&self, helpers: &BTreeSet<Vec<String>>) -> Vec<HostRead> {
        let parsed = self.parsed;
        let code = &parsed.lexed.code;
        let idents = &parsed.idents;
        let bindings = self.bindings();
        let in_use = in_use_declaration(idents, code);
        let mut out = Vec::new();
        const CPU_WHY: &str = "calls into the engine's CPU kernels, which read host slices";
        for binding in &bindings {
            let is_cpu = binding.path.len() >= 2 && binding.path[0] == ENGINE && binding.path[1] == "cpu";
            if !is_cpu || binding.path.iter().any(|s| CPU_DESCRIPTIONS.contains(&s.as_str())) {
                continue;
            }
            let kernel = binding.path[1..].join("::");
            if binding.glob {
                let why = "imports CPU kernels by glob, which hides where they are called";
                out.push(self.read(binding.line, "<top level>".into(), format!("{kernel}::*"), why));
            } else if binding.public {
                let why = "re-exports a CPU kernel, which hides where it is called";
                out.push(self.read(binding.line, "<top level>".into(), kernel, why));
            }
        }
        for (k, ident) in idents.iter().enumerate() {
            let end = ident.pos + ident.text.len();
            let next: String = code[end..].iter().filter(|c| !c.is_whitespace()).take(2).collect();
            let declared = k > 0
                && matches!(
                    idents[k - 1].text.as_str(),
                    "fn" | "struct" | "enum" | "mod" | "trait" | "type" | "const" | "static" | "let" | "macro_rules"
                )
                && code[idents[k - 1].pos + idents[k - 1].text.len()..ident.pos].iter().all(|c| c.is_whitespace());
            // `name:` names a field or a parameter; `name!` is a macro; `name::` is not a path's end.
            let named = next.starts_with(':') && !next.starts_with("::");
            if in_use[k] || declared || named || next.starts_with("::") || next.starts_with('!') {
                continue;
            }
            let item = || parsed.item_at(ident.pos);
            let before = text_before(code, ident.pos, 2);
            if before.ends_with('.') && !before.ends_with("..") {
                if let Some((name, why)) = TENSOR_HOST_ACCESSORS.iter().find(|(name, _)| *name == ident.text) {
                    out.push(self.read(ident.line, item(), name.to_string(), why));
                }
                continue;
            }
            // The whole path `a::b::name`.
            let mut segments = vec![ident.text.clone()];
            let mut j = k;
            while j > 0 && text_before(code, idents[j].pos, 2) == "::" {
                let colons = (0..idents[j].pos).rev().find(|&p| !code[p].is_whitespace()).unwrap_or(0) - 1;
                let previous = &idents[j - 1];
                if !code[previous.pos + previous.text.len()..colons].iter().all(|c| c.is_whitespace()) {
                    break;
                }
                segments.insert(0, previous.text.clone());
                j -= 1;
            }
            // `S { a, name, b }`: a field written short, not the import of the same name.
            let shorthand = segments.len() == 1
                && matches!(before.chars().last(), Some('{' | ','))
                && matches!(next.chars().next(), Some('}' | ','))
                && innermost_open(code, ident.pos) == Some('{');
            if shorthand {
                continue;
            }
            let resolved = self.resolve(&segments, &bindings);
            if resolved.len() > 2 && resolved[0] == ENGINE && resolved[1] == "cpu" {
                if !resolved.iter().any(|s| CPU_DESCRIPTIONS.contains(&s.as_str())) {
                    out.push(self.read(ident.line, item(), resolved[1..].join("::"), CPU_WHY));
                }
            } else if let Some((name, why)) = TENSOR_HOST_ACCESSORS.iter().find(|(name, _)| *name == ident.text)
                && resolved.len() >= 2
                && resolved[resolved.len() - 2] == "Tensor"
            {
                out.push(self.read(ident.line, item(), name.to_string(), why));
            } else if helpers.contains(&resolved) {
                // A bare name counts where it is called or passed (`f(..)`, `.map(f)`), not where a
                // field or local of the same name is written.
                let passed =
                    matches!(before.chars().last(), Some('(' | ',')) && matches!(next.chars().next(), Some(')' | ','));
                if segments.len() > 1 || next.starts_with('(') || passed {
                    let why = "calls a helper of this crate that reads host memory";
                    out.push(self.read(ident.line, item(), resolved[1..].join("::"), why));
                }
            }
        }
        out
    }
}

/// The innermost bracket still open at `pos`: `(`, `[` or `{`.
fn innermost_open(code: &[char], pos: usize) -> Option<char> {
    let mut depth = 0usize;
    for &c in code[..pos].iter().rev() {
        match c {
            ')' | ']' | '}' => depth += 1,
            '(' | '[' | '{' if depth == 0 => return Some(c),
            '(' | '[' | '{' => depth -= 1,
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(files: &[SourceFile]) -> Vec<(String, usize, String, String)> {
        host_reads(files, "layers/src").into_iter().map(|r| (r.path, r.line, r.item, r.accessor)).collect()
    }

    fn read(path: &str, line: usize, item: &str, accessor: &str) -> (String, usize, String, String) {
        (path.to_string(), line, item.to_string(), accessor.to_string())
    }

    #[test]
    fn tensor_host_accessors_are_found_by_method_and_by_path() {
        let file = SourceFile::new(
            "layers/src/relu.rs",
            "use conveyor_engine::{Layer, Tensor};\n\
             // x.as_f32() in a comment is fine; so is \"t.to_vec_f32()\" in a string:\n\
             const NOTE: &str = \"t.to_vec_f32()\";\n\
             impl Layer for Relu {\n\
             \x20   fn forward(&self, x: &Tensor) -> Result<Tensor> {\n\
             \x20       let v = x\n            .as_f32()?;\n\
             \x20       let all: Vec<_> = xs.iter().map(Tensor::to_vec_f32).collect();\n\
             \x20       Tensor::from_f32_init(x.shape().clone(), x.device(), |dst| Ok(dst))\n\
             \x20   }\n\
             }\n\
             fn as_f32(t: &Tensor) {}\n\
             #[cfg(test)]\n\
             fn only_in_tests(t: &Tensor) { t.as_f32_mut(); }\n",
        );
        assert_eq!(
            found(&[file]),
            [
                read("layers/src/relu.rs", 7, "Relu::forward", "as_f32"),
                read("layers/src/relu.rs", 8, "Relu::forward", "to_vec_f32"),
                read("layers/src/relu.rs", 9, "Relu::forward", "from_f32_init"),
            ]
        );
    }

    #[test]
    fn cpu_kernels_are_found_through_uses_renames_and_full_paths() {
        let file = SourceFile::new(
            "layers/src/conv.rs",
            "use conveyor_engine::cpu::{self as kernels, MatRef, Window2d, activation::{relu as r}};\n\
             use conveyor_engine as engine;\n\
             fn f(window: &Window2d) {\n\
             \x20   let m = MatRef::row_major(a, 1, 1);\n\
             \x20   let y = r(1.0);\n\
             \x20   kernels::conv::im2col(a, b);\n\
             \x20   engine::cpu::gemm::matmul(a, b);\n\
             \x20   conveyor_engine::cpu::attention::AttentionDims { batch: 1 };\n\
             \x20   let w = conveyor_engine::cpu::Window2d::new(1);\n\
             }\n\
             struct S { r: bool, packed: u8 }\n\
             fn g(r: bool, v: &[f32]) -> S { let packed = 1; S { r, packed } }\n\
             pub(crate) use conveyor_engine::cpu::uninit;\n\
             use conveyor_engine::cpu::softmax::*;\n\
             use conveyor_engine::cpu::packed;\n\
             fn h(v: &[f32]) { f(v, r, 2); packed::pack_rhs(v); }\n",
        );
        assert_eq!(
            found(&[file]),
            [
                read("layers/src/conv.rs", 13, "<top level>", "cpu::uninit"),
                read("layers/src/conv.rs", 14, "<top level>", "cpu::softmax::*"),
                read("layers/src/conv.rs", 4, "f", "cpu::MatRef::row_major"),
                read("layers/src/conv.rs", 5, "f", "cpu::activation::relu"),
                read("layers/src/conv.rs", 6, "f", "cpu::conv::im2col"),
                read("layers/src/conv.rs", 7, "f", "cpu::gemm::matmul"),
                read("layers/src/conv.rs", 16, "h", "conv::f"),
                read("layers/src/conv.rs", 16, "h", "cpu::activation::relu"),
                read("layers/src/conv.rs", 16, "h", "cpu::packed::pack_rhs"),
            ]
        );
    }

    #[test]
    fn helpers_that_read_host_memory_are_followed_to_their_callers() {
        let files = [
            SourceFile::new(
                "layers/src/tensor_io.rs",
                "pub(crate) fn values(t: &Tensor) -> &[f32] { t.as_f32().unwrap() }\n\
                 pub(crate) fn via(t: &Tensor) -> &[f32] { values(t) }\n\
                 pub(crate) fn clean(t: &Tensor) -> usize { t.numel() }\n",
            ),
            SourceFile::new(
                "layers/src/parallel/mod.rs",
                "mod shard;\nuse crate::tensor_io::{clean, via as host};\n\
                 impl Layer for Split {\n\
                 \x20   fn forward(&self) { let values = 3; let n = clean(x); let s = Thing { values }; }\n\
                 \x20   fn backward(&self) { let v: Vec<_> = xs.iter().map(host).collect(); }\n\
                 }\n",
            ),
            SourceFile::new(
                "layers/src/parallel/shard.rs",
                "fn g() { super::super::tensor_io::values(x); crate::tensor_io::clean(x); }\n",
            ),
        ];
        assert_eq!(
            found(&files),
            [
                read("layers/src/tensor_io.rs", 1, "values", "as_f32"),
                read("layers/src/tensor_io.rs", 2, "via", "tensor_io::values"),
                read("layers/src/parallel/mod.rs", 5, "Split::backward", "tensor_io::via"),
                read("layers/src/parallel/shard.rs", 1, "g", "tensor_io::values"),
            ]
        );
    }

    #[test]
    fn reads_name_their_function_and_bodies_can_be_read() {
        let file = SourceFile::new(
            "layers/src/x.rs",
            "impl<T: Into<u8>> crate::Layer for path::Outer<T> where T: Copy {\n\
             \x20   fn run(&self) -> impl Fn(f32) -> f32 {\n\
             \x20       fn inner(t: &Tensor) { t.as_f32(); }\n\
             \x20       if matches!(d, Device::Cpu(_)) { t.to_le_bytes(); }\n\
             \x20   }\n\
             }\n\
             fn takes(f: fn(&Tensor) -> u8, t: impl AsRef<Tensor>) { t.try_to_le_bytes(); }\n",
        );
        assert_eq!(
            found(std::slice::from_ref(&file)),
            [
                read("layers/src/x.rs", 3, "Outer::run::inner", "as_f32"),
                read("layers/src/x.rs", 4, "Outer::run", "to_le_bytes"),
                read("layers/src/x.rs", 7, "takes", "try_to_le_bytes"),
            ]
        );
        assert!(function_body(&file, "Outer::run").is_some_and(|body| body.contains("Device::Cpu")));
        assert_eq!(function_body(&file, "Outer::missing"), None);
    }
}
