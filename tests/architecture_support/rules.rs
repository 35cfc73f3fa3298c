//! One scanner per Architecture Invariant of `ARCHITECTURE.md`: each takes source text and returns
//! the violations, naming file and line. The tests at the bottom feed each one a synthetic
//! violation, so a scanner that silently stops matching fails there.
use super::scan::{
    SourceFile, Violation, dependencies, identifiers, in_use_declaration, is_shared_state, lex, text_before,
};

/// The crates in dependency order: each may depend only on crates before it.
pub const CRATE_ORDER: [&str; 4] = ["conveyor-schedules", "conveyor-engine", "conveyor-layers", "conveyor"];

/// Crates whose use would mean the schedules crate deals in tensors, devices or threads.
const THREAD_OR_TENSOR_CRATES: [&str; 9] =
    ["crossbeam", "rayon", "tokio", "parking_lot", "cudarc", "half", "gemm", "ndarray", "candle"];

/// `schedules/Cargo.toml`: no Conveyor crate, no thread or tensor crate.
pub fn schedules_manifest(manifest: &SourceFile) -> Vec<Violation> {
    let mut out = Vec::new();
    for (line, table, name) in dependencies(&manifest.text) {
        if name.starts_with("conveyor") {
            out.push(Violation::at(
                manifest,
                line,
                format!("[{table}] names `{name}`: schedules depend on no other Conveyor crate"),
            ));
        } else if THREAD_OR_TENSOR_CRATES.iter().any(|c| name == *c || name.starts_with(&format!("{c}-"))) {
            out.push(Violation::at(manifest, line, format!("[{table}] names `{name}`, a thread or tensor crate")));
        }
    }
    out
}

/// `schedules/src`: no tensor or device type, no threads or synchronisation, no Conveyor crate.
pub fn schedules_sources(files: &[SourceFile]) -> Vec<Violation> {
    let mut out = Vec::new();
    for file in files {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        for (k, ident) in idents.iter().enumerate() {
            let after_std = k > 0 && idents[k - 1].text == "std" && text_before(&lexed.code, ident.pos, 2) == "::";
            let why = match ident.text.as_str() {
                "Tensor" | "Device" | "Storage" => "a tensor or device type: schedules are pure data",
                "thread" | "spawn" | "thread_local" | "crossbeam" | "rayon" | "tokio" => {
                    "threads: schedules run nothing, the engine executes them"
                }
                "sync" if after_std => "`std::sync`: schedules share nothing between threads",
                "conveyor" | "conveyor_engine" | "conveyor_layers" => "another Conveyor crate",
                t if is_shared_state(t) => "a synchronisation primitive: schedules share nothing between threads",
                _ => continue,
            };
            out.push(Violation::at(file, ident.line, format!("`{}`: {why}", ident.text)));
        }
    }
    out
}

/// `schedules/src`: only `instruction.rs` builds a `Message` or `ChannelId`; the validator and the
/// simulators get theirs from `Instruction::recv_from` / `send_to`.
pub fn messages_built_outside_the_rule(files: &[SourceFile], rule_file: &str) -> Vec<Violation> {
    let mut out = Vec::new();
    for file in files.iter().filter(|f| f.path != rule_file) {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        for (k, ident) in idents.iter().enumerate() {
            if !matches!(ident.text.as_str(), "Message" | "ChannelId") {
                continue;
            }
            let declared = k > 0 && matches!(idents[k - 1].text.as_str(), "struct" | "enum" | "impl" | "for")
                || text_before(&lexed.code, ident.pos, 2) == "->";
            let next = lexed.code[ident.pos + ident.text.len()..].iter().find(|c| !c.is_whitespace());
            if next == Some(&'{') && !declared {
                out.push(Violation::at(
                    file,
                    ident.line,
                    format!("builds a `{}` by hand; derive it with Instruction::recv_from / send_to", ident.text),
                ));
            }
        }
    }
    out
}

/// Each of `users` still calls both halves of the rule.
pub fn rule_users_call_the_rule(files: &[SourceFile], users: &[&str]) -> Vec<Violation> {
    let mut out = Vec::new();
    for user in users {
        let Some(file) = files.iter().find(|f| f.path == *user) else {
            out.push(Violation { path: user.to_string(), line: 0, text: String::new(), why: "missing".into() });
            continue;
        };
        let code: String = lex(&file.text).code.into_iter().collect();
        for call in [".recv_from(", ".send_to("] {
            if !code.contains(call) {
                out.push(Violation::at(
                    file,
                    1,
                    format!("never calls `{call}`: it no longer derives messages from the rule"),
                ));
            }
        }
    }
    out
}

/// The concrete layers of `conveyor-layers`: type names (`impl Layer for X`, `impl Loss for X`,
/// and types made by a macro whose body implements `Layer`) and the strings their `kind()` returns.
#[derive(Debug, Default, PartialEq)]
pub struct ConcreteLayers {
    pub types: Vec<String>,
    pub kinds: Vec<String>,
}

pub fn concrete_layers(files: &[SourceFile]) -> ConcreteLayers {
    let mut layers = ConcreteLayers::default();
    let mut macros: Vec<String> = Vec::new();
    for file in files {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        for (k, ident) in idents.iter().enumerate() {
            // impl [path::]Layer for X / impl Loss for X
            if ident.text == "for" && k > 0 && matches!(idents[k - 1].text.as_str(), "Layer" | "Loss") {
                let Some(name) = idents.get(k + 1) else { continue };
                if text_before(&lexed.code, name.pos, 1) == "$" {
                    // A macro's body: the type is the invocation's argument.
                    let definition = idents[..k].iter().rposition(|i| i.text == "macro_rules");
                    if let Some(name) = definition.and_then(|d| idents.get(d + 1)) {
                        macros.push(name.text.clone());
                    }
                } else {
                    layers.types.push(name.text.clone());
                }
            }
            // fn kind(&self) -> &'static str { "X" } or { KIND } with const KIND: &str = "X";
            if ident.text == "kind" && k > 0 && idents[k - 1].text == "fn" {
                let open = (ident.pos..lexed.code.len()).find(|&p| lexed.code[p] == '{');
                let Some(open) = open else { continue };
                let body: String = lexed.code_with_strings[open + 1..].iter().collect();
                let body = body.trim_start();
                if let Some(rest) = body.strip_prefix('"') {
                    layers.kinds.push(rest.split('"').next().unwrap_or("").to_string());
                } else if let Some(constant) = body.split(|c: char| !c.is_alphanumeric() && c != '_').next()
                    && !constant.is_empty()
                {
                    let declared =
                        idents.iter().position(|i| i.text == constant && text_before(&lexed.code, i.pos, 5) == "const");
                    if let Some(d) = declared
                        && let Some((_, value)) = lexed.strings.iter().find(|(line, _)| *line >= idents[d].line)
                    {
                        layers.kinds.push(value.clone());
                    }
                }
            }
        }
    }
    // Invocations `name!(Type, "Kind", ..)` of macros that implement Layer.
    for file in files {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        for (k, ident) in idents.iter().enumerate() {
            let invoked = macros.contains(&ident.text)
                && lexed.code.get(ident.pos + ident.text.len()) == Some(&'!')
                && !(k > 0 && idents[k - 1].text == "macro_rules");
            if let (true, Some(name)) = (invoked, idents.get(k + 1)) {
                layers.types.push(name.text.clone());
                if let Some((_, kind)) = lexed.strings.iter().find(|(line, _)| *line >= name.line) {
                    layers.kinds.push(kind.clone());
                }
            }
        }
    }
    layers.types.sort();
    layers.types.dedup();
    layers.kinds.sort();
    layers.kinds.dedup();
    layers
}

/// Variants of every `enum` declared in `files`: (enum, variant, position of the declaration).
fn enum_variants(lexed: &super::scan::Lexed) -> Vec<(String, String, usize)> {
    let idents = identifiers(&lexed.code);
    let mut out = Vec::new();
    for (k, ident) in idents.iter().enumerate() {
        if ident.text != "enum" {
            continue;
        }
        let Some(name) = idents.get(k + 1) else { continue };
        let Some(open) = (name.pos..lexed.code.len()).find(|&p| lexed.code[p] == '{') else { continue };
        let mut depth = 0usize;
        let mut close = lexed.code.len();
        for p in open..lexed.code.len() {
            match lexed.code[p] {
                '{' | '(' => depth += 1,
                '}' | ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = p;
                        break;
                    }
                }
                _ => {}
            }
        }
        for variant in idents.iter().filter(|i| i.pos > open && i.pos < close) {
            let depth_here = lexed.code[open..variant.pos]
                .iter()
                .map(|c| match c {
                    '{' | '(' => 1,
                    '}' | ')' => -1,
                    _ => 0,
                })
                .sum::<i64>();
            let before = text_before(&lexed.code, variant.pos, 1);
            if depth_here == 1 && matches!(before.as_str(), "{" | "," | "]") {
                out.push((name.text.clone(), variant.text.clone(), variant.pos));
            }
        }
    }
    out
}

/// The engine names no concrete layer: no `conveyor_layers`, no layer type name (except where
/// it is the engine's own enum variant, such as `Activation::Relu`, the elementwise op), and no
/// string equal to a layer's `kind()` (comparing `layer.kind()` with one singles a layer out).
pub fn engine_names_concrete_layers(files: &[SourceFile], layers: &ConcreteLayers) -> Vec<Violation> {
    let lexed_files: Vec<_> = files.iter().map(|f| lex(&f.text)).collect();
    let mut engine_variants: Vec<(String, String)> = Vec::new();
    for lexed in &lexed_files {
        engine_variants.extend(enum_variants(lexed).into_iter().map(|(e, v, _)| (e, v)));
    }
    let mut out = Vec::new();
    for (file, lexed) in files.iter().zip(&lexed_files) {
        let declarations: Vec<usize> = enum_variants(lexed).into_iter().map(|(_, _, pos)| pos).collect();
        let idents = identifiers(&lexed.code);
        for (k, ident) in idents.iter().enumerate() {
            if ident.text == "conveyor_layers" {
                out.push(Violation::at(file, ident.line, "`conveyor_layers`: the engine sees only `dyn Layer`"));
                continue;
            }
            if !layers.types.contains(&ident.text) || declarations.contains(&ident.pos) {
                continue;
            }
            let own_variant = k > 0
                && text_before(&lexed.code, ident.pos, 2) == "::"
                && engine_variants.iter().any(|(e, v)| *e == idents[k - 1].text && *v == ident.text);
            if !own_variant {
                out.push(Violation::at(
                    file,
                    ident.line,
                    format!(
                        "names the concrete layer `{}` of conveyor-layers; the engine sees only `dyn Layer`",
                        ident.text
                    ),
                ));
            }
        }
        for (line, value) in &lexed.strings {
            if layers.kinds.contains(value) {
                out.push(Violation::at(
                    file,
                    *line,
                    format!("the string \"{value}\" is a concrete layer's `kind()`: behaviour must come through `Layer` methods, not the layer's name"),
                ));
            }
        }
    }
    out
}

/// `cfg(feature = "cuda")` (or `cfg_attr`, `cfg!`, inside `any(..)`) outside the switch files.
pub fn cuda_cfg_outside_switch(files: &[SourceFile], switch_files: &[&str]) -> Vec<Violation> {
    feature_cfg_outside_switch(
        files,
        "cuda",
        switch_files,
        "a `feature = \"cuda\"` condition outside device/mod.rs and device/cuda_enabled.rs: branch on `Device` instead",
    )
}

/// `cfg(feature = "mpi")` (or `cfg_attr`, `cfg!`, inside `any(..)`) outside the switch files.
pub fn mpi_cfg_outside_switch(files: &[SourceFile], switch_files: &[&str]) -> Vec<Violation> {
    feature_cfg_outside_switch(
        files,
        "mpi",
        switch_files,
        "a `feature = \"mpi\"` condition outside transport/mod.rs and transport/mpi_enabled.rs: go through \
         `Transport` (`mpi_disabled.rs` declares the same names) instead",
    )
}

/// A `feature = "<feature>"` condition outside the switch files, each reported with `why`.
fn feature_cfg_outside_switch(files: &[SourceFile], feature: &str, switch_files: &[&str], why: &str) -> Vec<Violation> {
    let condition = format!("=\"{feature}\"");
    let mut out = Vec::new();
    for file in files.iter().filter(|f| !switch_files.contains(&f.path.as_str())) {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        for ident in idents.iter().filter(|i| i.text == "feature") {
            let rest: String = lexed.code_with_strings[ident.pos + ident.text.len()..].iter().take(40).collect();
            let compact: String = rest.chars().filter(|c| !c.is_whitespace()).collect();
            if compact.starts_with(&condition) {
                out.push(Violation::at(file, ident.line, why));
            }
        }
    }
    out
}

/// Layers know nothing of schedules, placement or the runtime.
pub fn layers_name_schedules_placement_or_runtime(files: &[SourceFile]) -> Vec<Violation> {
    let mut out = Vec::new();
    for file in files {
        let lexed = lex(&file.text);
        let idents = identifiers(&lexed.code);
        let in_use = in_use_declaration(&idents, &lexed.code);
        for (k, ident) in idents.iter().enumerate() {
            let end = ident.pos + ident.text.len();
            let path_segment = text_before(&lexed.code, ident.pos, 2) == "::"
                || lexed.code[end..].iter().filter(|c| !c.is_whitespace()).take(2).collect::<String>() == "::";
            let why = match ident.text.as_str() {
                "conveyor_schedules" => "the schedules crate",
                "runtime" | "placement" if path_segment || in_use[k] => "an engine module layers must not know",
                "Trainer" | "TrainerBuilder" | "Schedule" | "ScheduleKind" | "Instruction" | "Plan" | "PlanConfig" => {
                    "a runtime, schedule or placement type"
                }
                _ => continue,
            };
            out.push(Violation::at(
                file,
                ident.line,
                format!("`{}`: {why}; layers know tensors and devices only", ident.text),
            ));
        }
    }
    out
}

/// Each Conveyor dependency of each crate points down [`CRATE_ORDER`]; `manifests` are
/// (package name, manifest). `forbidden` lists (crate, dependency) pairs ruled out even downward.
pub fn dependency_direction(manifests: &[(String, SourceFile)], forbidden: &[(&str, &str)]) -> Vec<Violation> {
    let rank = |name: &str| CRATE_ORDER.iter().position(|c| *c == name);
    let mut out = Vec::new();
    for (package, manifest) in manifests {
        let Some(own) = rank(package) else {
            out.push(Violation::at(manifest, 1, format!("`{package}` is not in ARCHITECTURE.md's dependency order")));
            continue;
        };
        for (line, table, dep) in dependencies(&manifest.text) {
            if !dep.starts_with("conveyor") {
                continue;
            }
            match rank(&dep) {
                None => {
                    out.push(Violation::at(manifest, line, format!("[{table}] `{dep}` is not in the dependency order")))
                }
                Some(r) if r >= own => out.push(Violation::at(
                    manifest,
                    line,
                    format!(
                        "[{table}] `{package}` depends on `{dep}`: dependencies must point {}",
                        CRATE_ORDER.join(" <- ")
                    ),
                )),
                Some(_) if forbidden.contains(&(package.as_str(), dep.as_str())) => {
                    out.push(Violation::at(manifest, line, format!("[{table}] `{package}` must not depend on `{dep}`")))
                }
                Some(_) => {}
            }
        }
    }
    out
}

/// The package name of a manifest (`name = ".."` under `[package]`).
pub fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package && let Some(value) = line.strip_prefix("name") {
            return value.split('"').nth(1).map(str::to_string);
        }
    }
    None
}

/// The `members = [..]` of a workspace manifest.
pub fn workspace_members(manifest: &str) -> Vec<String> {
    let Some(start) = manifest.find("members") else { return Vec::new() };
    let list = &manifest[start..];
    let list = &list[list.find('[').unwrap_or(0)..list.find(']').unwrap_or(list.len())];
    list.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, text: &str) -> SourceFile {
        SourceFile::new(path, text)
    }

    fn lines(violations: &[Violation]) -> Vec<(String, usize)> {
        violations.iter().map(|v| (v.path.clone(), v.line)).collect()
    }

    #[test]
    fn schedules_scanners_find_tensors_threads_and_conveyor_crates() {
        let manifest = file(
            "schedules/Cargo.toml",
            "[dependencies]\nserde.workspace = true\nconveyor-engine.workspace = true\n[dev-dependencies]\ncrossbeam = \"0.8\"\n",
        );
        assert_eq!(
            lines(&schedules_manifest(&manifest)),
            [("schedules/Cargo.toml".into(), 3), ("schedules/Cargo.toml".into(), 5)]
        );
        let source = file(
            "schedules/src/x.rs",
            "// Tensor and thread in a comment are fine.\nstruct BlockedDevice;\nfn f(t: &conveyor_engine::Tensor) {\n    std::thread::spawn(|| {});\n    let s = \"Device\";\n    let a = std::sync::atomic::AtomicUsize::new(0);\n}\n",
        );
        let found: Vec<(usize, String)> = schedules_sources(&[source])
            .into_iter()
            .map(|v| (v.line, v.why.split('`').nth(1).unwrap().to_string()))
            .collect();
        let expected =
            [(3, "conveyor_engine"), (3, "Tensor"), (4, "thread"), (4, "spawn"), (6, "sync"), (6, "AtomicUsize")];
        assert_eq!(found, expected.map(|(l, t)| (l, t.to_string())));
    }

    #[test]
    fn hand_built_messages_are_found() {
        let files = [
            file(
                "schedules/src/instruction.rs",
                "pub struct Message { a: u8 }\nfn f() -> Message { Message { a: 0 } }\n",
            ),
            file(
                "schedules/src/simulate.rs",
                "fn g(i: Instruction) -> Message {\n    let m = i.recv_from(3);\n    let fake = Message { a: 1 };\n}\n",
            ),
        ];
        assert_eq!(
            lines(&messages_built_outside_the_rule(&files, "schedules/src/instruction.rs")),
            [("schedules/src/simulate.rs".into(), 3)]
        );
        let users = rule_users_call_the_rule(&files, &["schedules/src/simulate.rs"]);
        assert_eq!(users.len(), 1, "{users:?}");
        assert!(users[0].why.contains(".send_to("), "{users:?}");
    }

    #[test]
    fn concrete_layers_and_their_kinds_are_collected() {
        let files = [
            file(
                "layers/src/linear.rs",
                "pub struct Linear;\nimpl Layer for Linear {\n    fn kind(&self) -> &'static str {\n        \"Linear\"\n    }\n}\n",
            ),
            file(
                "layers/src/attention.rs",
                "const KIND: &str = \"MultiheadSelfAttention\";\nimpl conveyor_engine::Layer for Mhsa {\n    fn kind(&self) -> &'static str {\n        KIND\n    }\n}\n",
            ),
            file("layers/src/loss.rs", "impl Loss for CrossEntropyLoss {}\n"),
            file(
                "layers/src/activation.rs",
                "macro_rules! act {\n    ($name:ident, $kind:literal) => {\n        impl Layer for $name {\n            fn kind(&self) -> &'static str { $kind }\n        }\n    };\n}\nact!(Relu, \"ReLU\");\nact!(\n    Tanh,\n    \"Tanh\"\n);\n",
            ),
        ];
        let layers = concrete_layers(&files);
        assert_eq!(layers.types, ["CrossEntropyLoss", "Linear", "Mhsa", "Relu", "Tanh"]);
        assert_eq!(layers.kinds, ["Linear", "MultiheadSelfAttention", "ReLU", "Tanh"]);
    }

    #[test]
    fn engine_naming_a_layer_is_found_but_its_own_variants_are_not() {
        let layers = ConcreteLayers { types: vec!["Relu".into(), "Linear".into()], kinds: vec!["Embedding".into()] };
        let files = [
            file(
                "engine/src/ops.rs",
                "pub enum Activation {\n    /// doc\n    Relu,\n    Gelu(u8),\n}\nfn f(a: Activation) { if let Activation::Relu = a {} }\n",
            ),
            file(
                "engine/src/profile.rs",
                "fn g(layer: &dyn Layer) {\n    // Linear in a comment is fine\n    if layer.kind() == \"Embedding\" {}\n    let l: Box<Linear>;\n    let r = Relu;\n    use conveyor_layers::Flatten;\n}\n",
            ),
        ];
        assert_eq!(
            lines(&engine_names_concrete_layers(&files, &layers)),
            [
                ("engine/src/profile.rs".into(), 4),
                ("engine/src/profile.rs".into(), 5),
                ("engine/src/profile.rs".into(), 6),
                ("engine/src/profile.rs".into(), 3)
            ]
        );
    }

    #[test]
    fn mpi_conditions_outside_the_switch_are_found() {
        let files = [
            file(
                "engine/src/transport/mod.rs",
                "#[cfg_attr(feature = \"mpi\", path = \"mpi_enabled.rs\")]\nmod mpi_backend;\n",
            ),
            file(
                "src/cli/ranks.rs",
                "// cfg(feature = \"mpi\") in a comment is fine\n#[cfg(feature = \"mpich\")]\nfn a() {}\n#[cfg(all(unix, feature = \"mpi\"))]\nfn b() { if cfg!(feature=\"mpi\") {} }\nconst S: &str = \"feature = mpi\";\n",
            ),
        ];
        assert_eq!(
            lines(&mpi_cfg_outside_switch(&files, &["engine/src/transport/mod.rs"])),
            [("src/cli/ranks.rs".into(), 4), ("src/cli/ranks.rs".into(), 5)]
        );
        assert_eq!(lines(&cuda_cfg_outside_switch(&files, &[])), []);
    }

    #[test]
    fn cuda_conditions_outside_the_switch_are_found() {
        let files = [
            file(
                "engine/src/device/mod.rs",
                "#[cfg_attr(feature = \"cuda\", path = \"cuda_enabled.rs\")]\nmod cuda;\n",
            ),
            file(
                "engine/src/tensor/mod.rs",
                "// cfg(feature = \"cuda\") in a comment is fine\n#[cfg(feature = \"nccl\")]\nfn a() {}\n#[cfg(any(test, feature   =   \"cuda\"))]\nfn b() { if cfg!(feature = \"cuda\") {} }\nconst S: &str = \"feature = cuda\";\n",
            ),
        ];
        assert_eq!(
            lines(&cuda_cfg_outside_switch(&files, &["engine/src/device/mod.rs"])),
            [("engine/src/tensor/mod.rs".into(), 4), ("engine/src/tensor/mod.rs".into(), 5)]
        );
    }

    #[test]
    fn layers_naming_runtime_placement_or_schedules_is_found() {
        let source = file(
            "layers/src/x.rs",
            "use conveyor_engine::{Layer, Tensor};\nuse conveyor_engine::runtime::Recompute;\nfn f(placement: u8) -> conveyor_schedules::OpKind {\n    let s: Schedule;\n    conveyor_engine::placement::place_manually();\n}\n",
        );
        assert_eq!(
            lines(&layers_name_schedules_placement_or_runtime(&[source])),
            [
                ("layers/src/x.rs".into(), 2),
                ("layers/src/x.rs".into(), 3),
                ("layers/src/x.rs".into(), 4),
                ("layers/src/x.rs".into(), 5)
            ]
        );
    }

    #[test]
    fn dependencies_pointing_up_are_found() {
        let manifests = vec![
            ("conveyor-schedules".to_string(), file("schedules/Cargo.toml", "[dependencies]\nserde = \"1\"\n")),
            (
                "conveyor-engine".to_string(),
                file(
                    "engine/Cargo.toml",
                    "[dependencies]\nconveyor-schedules.workspace = true\n[dev-dependencies]\nconveyor-layers.workspace = true\n",
                ),
            ),
            (
                "conveyor-layers".to_string(),
                file(
                    "layers/Cargo.toml",
                    "[dependencies]\nconveyor-engine.workspace = true\nconveyor-schedules.workspace = true\n",
                ),
            ),
            ("conveyor-extra".to_string(), file("extra/Cargo.toml", "[dependencies]\n")),
        ];
        let found = dependency_direction(&manifests, &[("conveyor-layers", "conveyor-schedules")]);
        assert_eq!(
            lines(&found),
            [("engine/Cargo.toml".into(), 4), ("layers/Cargo.toml".into(), 3), ("extra/Cargo.toml".into(), 1)]
        );
        assert_eq!(
            package_name("[package]\nname = \"conveyor-engine\"\n[dependencies]\nname = \"x\"\n").as_deref(),
            Some("conveyor-engine")
        );
        assert_eq!(workspace_members("[workspace]\nmembers = [\"engine\", \"layers\"]\n"), ["engine", "layers"]);
    }
}
