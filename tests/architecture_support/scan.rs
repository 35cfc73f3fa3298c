//! Source scanning for the architecture tests: a small Rust lexer (comments out, string literals
//! optionally out, every newline kept so positions keep their line), identifier tokens, the item
//! each position sits in, and a minimal reader of `Cargo.toml` dependency tables.
//!
//! Scanning text, not types, is the honest check for rules such as "no `cfg(feature = "cuda")`
//! outside two files": the compiler enforces none of them. Each scanner is a plain function of
//! source text so `tests` below can prove it finds a synthetic violation.
use std::fmt;
use std::path::Path;

/// One source file: its path from the workspace root (with `/`) and its text.
#[derive(Clone, Debug)]
pub struct SourceFile {
    pub path: String,
    pub text: String,
}

impl SourceFile {
    pub fn new(path: &str, text: &str) -> SourceFile {
        SourceFile { path: path.to_string(), text: text.to_string() }
    }

    /// The file's line `line` (1-based), trimmed, for messages.
    pub fn line_text(&self, line: usize) -> &str {
        self.text.lines().nth(line.saturating_sub(1)).unwrap_or("").trim()
    }
}

/// Every `.rs` file under `dir` (relative to `root`), sorted by path.
pub fn rust_files(root: &Path, dir: &str) -> Vec<SourceFile> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<SourceFile>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let text =
                    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
                let relative = path.strip_prefix(root).expect("under the root").to_string_lossy().replace('\\', "/");
                out.push(SourceFile { path: relative, text });
            }
        }
    }
    let mut out = Vec::new();
    walk(root, &root.join(dir), &mut out);
    assert!(!out.is_empty(), "no .rs files under {dir}: the scan would check nothing");
    out
}

/// A broken rule: where, the offending line, and why it breaks the invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub path: String,
    pub line: usize,
    pub text: String,
    pub why: String,
}

impl Violation {
    pub fn at(file: &SourceFile, line: usize, why: impl Into<String>) -> Violation {
        Violation { path: file.path.clone(), line, text: file.line_text(line).to_string(), why: why.into() }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: `{}`: {}", self.path, self.line, self.text, self.why)
    }
}

/// Panics listing every violation, one per line, under `invariant`.
pub fn assert_none(invariant: &str, violations: &[Violation]) {
    if !violations.is_empty() {
        let mut list: Vec<String> = violations.iter().map(|v| format!("  {v}")).collect();
        list.dedup();
        panic!("Architecture Invariant broken: {invariant}\n{}", list.join("\n"));
    }
}

/// A file lexed: `code` has comments and string-literal contents blanked, `code_with_strings`
/// only comments; both have one char per source char, so a position means the same in all three.
/// `#[cfg(test)] mod ... { }` blocks are blanked too: unit tests are not the shipped code.
pub struct Lexed {
    pub code: Vec<char>,
    pub code_with_strings: Vec<char>,
    /// String literals: (line of the opening quote, contents as written, escapes undecoded).
    pub strings: Vec<(usize, String)>,
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn blank(c: char) -> char {
    if c == '\n' { '\n' } else { ' ' }
}

pub fn lex(text: &str) -> Lexed {
    let mut lexed = lex_keeping_tests(text);
    blank_test_modules(&mut lexed);
    lexed
}

/// [`lex`] without blanking test items.
fn lex_keeping_tests(text: &str) -> Lexed {
    let chars: Vec<char> = text.chars().collect();
    let n = chars.len();
    let mut code = Vec::with_capacity(n);
    let mut with_strings = Vec::with_capacity(n);
    let mut strings = Vec::new();
    let mut line = 1;
    let mut i = 0;
    // Pushes a source char as code, as string content, or as comment.
    macro_rules! emit {
        ($c:expr, code) => {{
            let c: char = $c;
            code.push(c);
            with_strings.push(c);
            line += usize::from(c == '\n');
        }};
        ($c:expr, string) => {{
            let c: char = $c;
            code.push(blank(c));
            with_strings.push(c);
            line += usize::from(c == '\n');
        }};
        ($c:expr, comment) => {{
            let c: char = $c;
            code.push(blank(c));
            with_strings.push(blank(c));
            line += usize::from(c == '\n');
        }};
    }
    while i < n {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < n && chars[i] != '\n' {
                emit!(chars[i], comment);
                i += 1;
            }
            continue;
        }
        if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < n {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    emit!(chars[i], comment);
                    emit!(chars[i + 1], comment);
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    emit!(chars[i], comment);
                    emit!(chars[i + 1], comment);
                    i += 2;
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                } else {
                    emit!(chars[i], comment);
                    i += 1;
                }
            }
            continue;
        }
        let at_boundary = |k: usize| k == 0 || !is_ident_char(chars[k - 1]);
        // Raw strings: r"..", r#".."#, br#".."#.
        if c == 'r' && (at_boundary(i) || (chars[i - 1] == 'b' && at_boundary(i - 1))) {
            let mut j = i + 1;
            while chars.get(j) == Some(&'#') {
                j += 1;
            }
            let hashes = j - i - 1;
            if chars.get(j) == Some(&'"') {
                for &c in &chars[i..=j] {
                    emit!(c, code);
                }
                let start_line = line;
                let mut content = String::new();
                let mut k = j + 1;
                while k < n && !(chars[k] == '"' && (1..=hashes).all(|h| chars.get(k + h) == Some(&'#'))) {
                    content.push(chars[k]);
                    emit!(chars[k], string);
                    k += 1;
                }
                for &c in &chars[k..(k + 1 + hashes).min(n)] {
                    emit!(c, code);
                }
                strings.push((start_line, content));
                i = k + 1 + hashes;
                continue;
            }
        }
        if c == '"' {
            emit!(chars[i], code);
            i += 1;
            let start_line = line;
            let mut content = String::new();
            while i < n && chars[i] != '"' {
                if chars[i] == '\\' && i + 1 < n {
                    content.push(chars[i]);
                    content.push(chars[i + 1]);
                    emit!(chars[i], string);
                    emit!(chars[i + 1], string);
                    i += 2;
                } else {
                    content.push(chars[i]);
                    emit!(chars[i], string);
                    i += 1;
                }
            }
            if i < n {
                emit!(chars[i], code);
                i += 1;
            }
            strings.push((start_line, content));
            continue;
        }
        if c == '\'' {
            // A char literal ('x', '\n', '\u{..}', '"') or a lifetime / label ('a).
            let end = if next == Some('\\') {
                (i + 3..n).find(|&k| chars[k] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    emit!(chars[i], code);
                    for &c in &chars[i + 1..end] {
                        emit!(c, string);
                    }
                    emit!(chars[end], code);
                    i = end + 1;
                }
                None => {
                    emit!(chars[i], code);
                    i += 1;
                }
            }
            continue;
        }
        emit!(chars[i], code);
        i += 1;
    }
    Lexed { code, code_with_strings: with_strings, strings }
}

/// Blanks every item under `#[cfg(test)]`: an inline `mod name { .. }` block (strings inside it
/// are dropped too), a test-only `fn`, `impl` or `use`, and the declaration `mod name;` (whose file
/// [`without_test_files`] drops).
fn blank_test_modules(lexed: &mut Lexed) {
    let marker: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut i = 0;
    while i + marker.len() <= lexed.code.len() {
        if lexed.code[i..i + marker.len()] != marker[..] {
            i += 1;
            continue;
        }
        // The item ends at the first `;` outside brackets, or at the `}` closing its first `{`.
        let after = i + marker.len();
        let mut depth = 0i64;
        let mut close = None;
        let mut k = after;
        while k < lexed.code.len() {
            match lexed.code[k] {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                ';' if depth == 0 => {
                    close = Some(k);
                    break;
                }
                '{' if depth == 0 => {
                    close = matching_brace(&lexed.code, k);
                    break;
                }
                _ => {}
            }
            k += 1;
        }
        let close = close.unwrap_or(lexed.code.len() - 1);
        let first_line = line_of(&lexed.code, i);
        let last_line = line_of(&lexed.code, close);
        for k in i..=close {
            lexed.code[k] = blank(lexed.code[k]);
            lexed.code_with_strings[k] = blank(lexed.code_with_strings[k]);
        }
        lexed.strings.retain(|&(line, _)| line < first_line || line > last_line);
        i = close + 1;
    }
}

/// The position of the `}` closing the `{` at `open`, if the code closes it.
pub fn matching_brace(code: &[char], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in code.iter().enumerate().skip(open) {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// `files` without the files of out-of-line test modules: for each `#[cfg(test)] mod name;` in
/// `a/b.rs` (or `a/mod.rs`, `a/lib.rs`), the files `a/b/name.rs` (`a/name.rs`) and everything
/// under `a/b/name/` (`a/name/`).
pub fn without_test_files(files: Vec<SourceFile>) -> Vec<SourceFile> {
    let mut test_modules: Vec<String> = Vec::new();
    for file in &files {
        let dir = match file.path.rsplit_once('/') {
            Some((dir, "mod.rs" | "lib.rs" | "main.rs")) => dir.to_string(),
            _ => file.path.trim_end_matches(".rs").to_string(),
        };
        let code: String = lex_keeping_tests(&file.text).code.into_iter().collect();
        let mut rest = code.as_str();
        while let Some(at) = rest.find("#[cfg(test)]") {
            rest = &rest[at + "#[cfg(test)]".len()..];
            // `mod name;`, `pub mod name;`, `pub(crate) mod name;`
            let words: Vec<&str> = rest
                .split(|c: char| !is_ident_char(c))
                .filter(|w| !w.is_empty() && !matches!(*w, "pub" | "crate" | "super"))
                .take(2)
                .collect();
            let declaration = rest.find(['{', ';']).is_some_and(|p| rest.as_bytes()[p] == b';');
            if let (["mod", name], true) = (words.as_slice(), declaration) {
                test_modules.push(format!("{dir}/{name}"));
            }
        }
    }
    files
        .into_iter()
        .filter(|f| !test_modules.iter().any(|m| f.path == format!("{m}.rs") || f.path.starts_with(&format!("{m}/"))))
        .collect()
}

/// The 1-based line of position `pos`.
pub fn line_of(chars: &[char], pos: usize) -> usize {
    1 + chars[..pos.min(chars.len())].iter().filter(|&&c| c == '\n').count()
}

/// An identifier token of lexed code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident {
    pub pos: usize,
    pub line: usize,
    pub text: String,
}

/// Identifier tokens (numbers skipped), in order.
pub fn identifiers(code: &[char]) -> Vec<Ident> {
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < code.len() {
        let c = code[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if is_ident_char(c) {
            let start = i;
            while i < code.len() && is_ident_char(code[i]) {
                i += 1;
            }
            // Lifetimes and labels ('a, 'static) are not identifiers.
            let lifetime = start > 0 && code[start - 1] == '\'';
            if !c.is_ascii_digit() && !lifetime {
                out.push(Ident { pos: start, line, text: code[start..i].iter().collect() });
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The text just before position `pos`, whitespace skipped: `n` chars of it.
pub fn text_before(code: &[char], pos: usize, n: usize) -> String {
    let mut end = pos;
    while end > 0 && code[end - 1].is_whitespace() {
        end -= 1;
    }
    code[end.saturating_sub(n)..end].iter().collect()
}

/// Positions inside `use ...;` declarations (imports share nothing and run nothing).
pub fn in_use_declaration(idents: &[Ident], code: &[char]) -> Vec<bool> {
    let mut inside = vec![false; idents.len()];
    let mut k = 0;
    while k < idents.len() {
        if idents[k].text == "use" {
            let end = (idents[k].pos..code.len()).find(|&p| code[p] == ';').unwrap_or(code.len());
            while k < idents.len() && idents[k].pos < end {
                inside[k] = true;
                k += 1;
            }
        } else {
            k += 1;
        }
    }
    inside
}

/// For each identifier, the name of the item it sits in: the last `fn`, `struct`, `enum`,
/// `static`, `const`, `trait`, `type`, `mod` or `macro_rules!` declared at or before it.
pub fn enclosing_items(idents: &[Ident]) -> Vec<String> {
    const KEYWORDS: [&str; 8] = ["fn", "struct", "enum", "static", "const", "trait", "type", "mod"];
    let mut current = String::from("<file>");
    let mut out = Vec::with_capacity(idents.len());
    for (k, ident) in idents.iter().enumerate() {
        if KEYWORDS.contains(&ident.text.as_str()) || ident.text == "macro_rules" {
            // `static mut X`, `const fn f`, `const unsafe fn f`: the name is the first other word.
            let name = idents[k + 1..]
                .iter()
                .map(|i| i.text.as_str())
                .find(|t| !matches!(*t, "mut" | "fn" | "unsafe" | "async" | "extern"));
            if let Some(name) = name {
                current = name.to_string();
            }
        }
        out.push(current.clone());
    }
    out
}

/// A lock-like or shared-state name found in code: where, and in which item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub path: String,
    pub line: usize,
    pub item: String,
    pub token: String,
    /// The line, trimmed.
    pub text: String,
}

impl Site {
    pub fn violation(&self, why: impl Into<String>) -> Violation {
        Violation { path: self.path.clone(), line: self.line, text: self.text.clone(), why: why.into() }
    }
}

/// Every identifier of `files` for which `is_match` holds, outside `use` declarations, with the
/// item it sits in.
pub fn sites(files: &[SourceFile], is_match: impl Fn(&str) -> bool) -> Vec<Site> {
    let mut out = Vec::new();
    for file in files {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        let in_use = in_use_declaration(&idents, &lexed.code);
        let items = enclosing_items(&idents);
        for (k, ident) in idents.iter().enumerate() {
            if !in_use[k] && is_match(&ident.text) {
                out.push(Site {
                    path: file.path.clone(),
                    line: ident.line,
                    item: items[k].clone(),
                    token: ident.text.clone(),
                    text: file.line_text(ident.line).to_string(),
                });
            }
        }
    }
    out
}

/// Lock types: anything named `*Mutex*`, `*RwLock*` or crossbeam's `ShardedLock`.
pub fn is_lock(token: &str) -> bool {
    token.contains("Mutex") || token.contains("RwLock") || token == "ShardedLock"
}

/// Anything through which threads can share mutable state other than a channel.
pub fn is_shared_state(token: &str) -> bool {
    is_lock(token)
        || token.starts_with("Atomic")
        || matches!(token, "Condvar" | "OnceLock" | "OnceCell" | "LazyLock" | "UnsafeCell" | "Barrier" | "thread_local")
}

/// `(line, table, crate name)` of every dependency in a `Cargo.toml`: keys of `[dependencies]`,
/// `[dev-dependencies]`, `[build-dependencies]` and their `[target.'..'.*]` forms, tables such as
/// `[dependencies.foo]`, and renamed packages (`bar = { package = "foo" }` counts as `foo`).
pub fn dependencies(cargo_toml: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    let mut table: Option<String> = None;
    for (index, raw) in cargo_toml.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.starts_with('[') {
            let header = line.trim_matches(|c| c == '[' || c == ']').trim().to_string();
            let kinds = ["dependencies", "dev-dependencies", "build-dependencies"];
            let last_two: Vec<&str> = header.rsplitn(2, '.').collect();
            table = None;
            if kinds.iter().any(|k| header == *k || header.ends_with(&format!(".{k}"))) {
                table = Some(header);
            } else if last_two.len() == 2
                && kinds.iter().any(|k| last_two[1] == *k || last_two[1].ends_with(&format!(".{k}")))
            {
                // [dependencies.foo]
                out.push((line_no, last_two[1].to_string(), last_two[0].trim_matches('"').to_string()));
            }
            continue;
        }
        let Some(table) = &table else { continue };
        let Some((key, value)) = line.split_once('=') else { continue };
        let key = key.trim().split('.').next().unwrap_or("").trim_matches('"').to_string();
        if key.is_empty() {
            continue;
        }
        let renamed = value.split("package").nth(1).and_then(|rest| rest.split('"').nth(1)).map(str::to_string);
        out.push((line_no, table.clone(), renamed.unwrap_or(key)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexer_blanks_comments_and_strings_but_keeps_lines() {
        let text = "let a = \"// not a comment\"; // Mutex here\n/* Mutex\n /* nested */ */ let b = 'x';\nlet r = r#\"Mutex \" \"#; fn f<'a>(x: &'a str) {}\n";
        let lexed = lex(text);
        let code: String = lexed.code.iter().collect();
        assert_eq!(code.lines().count(), text.lines().count(), "{code:?}");
        assert!(!code.contains("Mutex"), "comments and strings are blanked: {code}");
        assert!(code.contains("let b = ' ';"), "{code}");
        assert!(code.contains("fn f<'a>(x: &'a str)"), "lifetimes stay code: {code}");
        let strings: Vec<&str> = lexed.strings.iter().map(|(_, s)| s.as_str()).collect();
        assert_eq!(strings, ["// not a comment", "Mutex \" "]);
        assert_eq!(lexed.strings[1].0, 4, "the raw string opens on line 4");
    }

    #[test]
    fn lexer_drops_inline_test_modules() {
        let lexed = lex(
            "fn shipped() {}\n#[cfg(test)]\nmod tests {\n    fn t() { let m = Mutex::new(\"Linear\"); }\n}\nfn after() {}\n",
        );
        let idents: Vec<String> = identifiers(&lexed.code).into_iter().map(|i| i.text).collect();
        assert_eq!(idents, ["fn", "shipped", "fn", "after"]);
        assert!(lexed.strings.is_empty());
    }

    #[test]
    fn lexer_drops_test_items_and_test_module_files_are_dropped() {
        let text = "#[cfg(test)]\nfn helper() { Mutex::new(0); }\nfn shipped() {}\n#[cfg(test)]\nmod tests;\n";
        let idents: Vec<String> = identifiers(&lex(text).code).into_iter().map(|i| i.text).collect();
        assert_eq!(idents, ["fn", "shipped"]);
        let files = vec![
            SourceFile::new("a/src/tensor/mod.rs", text),
            SourceFile::new("a/src/tensor/tests.rs", "fn t() {}\n"),
            SourceFile::new("a/src/tensor/other.rs", "fn o() {}\n"),
            SourceFile::new("a/src/conv.rs", "#[cfg(test)]\npub(crate) mod conv_tests;\n"),
            SourceFile::new("a/src/conv/conv_tests/more.rs", "fn m() {}\n"),
        ];
        let kept: Vec<String> = without_test_files(files).into_iter().map(|f| f.path).collect();
        assert_eq!(kept, ["a/src/tensor/mod.rs", "a/src/tensor/other.rs", "a/src/conv.rs"]);
    }

    #[test]
    fn sites_name_their_item_and_skip_imports() {
        let file = SourceFile::new(
            "x.rs",
            "use std::sync::{\n    Arc,\n    Mutex,\n};\nstruct Shared {\n    state: Mutex<u8>,\n}\nconst fn g() -> &'static str { \"\" }\nfn hot() {\n    let l = parking_lot::RwLock::new(0);\n}\n",
        );
        let found = sites(&[file], is_lock);
        let at: Vec<(usize, &str, &str)> = found.iter().map(|s| (s.line, s.item.as_str(), s.token.as_str())).collect();
        assert_eq!(at, [(6, "Shared", "Mutex"), (10, "hot", "RwLock")]);
    }

    #[test]
    fn dependency_tables_are_read() {
        let toml = "[package]\nname = \"x\"\n[dependencies]\nconveyor-engine.workspace = true\nserde = { version = \"1\" } # c\nalias = { package = \"conveyor-layers\", path = \"..\" }\n[dev-dependencies]\nproptest = \"1\"\n[target.'cfg(unix)'.dependencies]\nlibc = \"0.2\"\n[dependencies.conveyor-schedules]\npath = \"s\"\n[features]\ncuda = []\n";
        let names: Vec<(usize, String)> = dependencies(toml).into_iter().map(|(l, _, n)| (l, n)).collect();
        let expected = [
            (4, "conveyor-engine"),
            (5, "serde"),
            (6, "conveyor-layers"),
            (8, "proptest"),
            (10, "libc"),
            (11, "conveyor-schedules"),
        ];
        assert_eq!(names, expected.map(|(l, n)| (l, n.to_string())));
    }
}
