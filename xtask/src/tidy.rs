//! `cargo xtask tidy`: mechanical checks of the architecture invariants in
//! `docs/ARCHITECTURE.md`, read from `cargo metadata`.
//!
//! Rules:
//! 1. `kvatlas-hash` has no internal dependency and no normal dependency beyond `xxhash-rust`
//!    and an optional `serde`.
//! 2. Internal crates only depend downwards: hash ← index ← events ← server.
//! 3. `kvatlas-index` and `kvatlas-events` never reach tokio, tonic, prost or hyper, directly or
//!    transitively, through normal dependencies.
//! 4. Nothing depends on `kvatlas-bench` or `xtask` (of any dependency kind).
//! 5. Every Rust source file under `crates/` opens with a `//!` module doc.
//! 6. `kvatlas-proto`, built on its own (`cargo tree -p kvatlas-proto`), reaches no internal
//!    crate but `kvatlas-hash` and none of axum, zmq, metrics exporters or logging setup: a
//!    router that imports it gets the generated code, its gRPC runtime and the hash crate only.
//! 7. The `kvatlas` binary is thin: one file, `main.rs`, with `main` as its only function and no
//!    `impl` blocks (its commands live in `kvatlas_server::cli`).
//! 8. Each crate copied under `third_party/` is the package the build resolves under that name
//!    (its `[patch.crates-io]` entry still applies).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// A dependency edge as the rules see it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Edge {
    pub(crate) from: String,
    pub(crate) to: String,
    /// `normal`, `dev` or `build`.
    pub(crate) kind: String,
    pub(crate) optional: bool,
}

/// The facts the rules need: the workspace's own packages, their declared dependencies, and the
/// resolved graph of normal dependencies (package name → names it depends on).
#[derive(Debug, Default)]
pub(crate) struct Graph {
    pub(crate) members: BTreeSet<String>,
    pub(crate) declared: Vec<Edge>,
    pub(crate) resolved_normal: BTreeMap<String, BTreeSet<String>>,
}

/// Internal crates each internal crate may depend on (normal or dev), bottom to top.
const ALLOWED_INTERNAL: &[(&str, &[&str])] = &[
    ("kvatlas-hash", &[]),
    ("kvatlas-index", &["kvatlas-hash"]),
    ("kvatlas-events", &["kvatlas-hash", "kvatlas-index"]),
    ("kvatlas-proto", &["kvatlas-hash"]),
    (
        "kvatlas-server",
        &[
            "kvatlas-hash",
            "kvatlas-index",
            "kvatlas-events",
            "kvatlas-proto",
        ],
    ),
    // The simulated fleet and `kvatlas demo`: beside the service, talking to it only as engines
    // (ZMQ) and a router (the proto client) do.
    (
        "kvatlas-fleet",
        &["kvatlas-hash", "kvatlas-index", "kvatlas-proto"],
    ),
    // The binary's tests also drive a server with the proto client and the reference model,
    // which they feed the engines' real payloads through kvatlas-events' converter.
    (
        "kvatlas",
        &[
            "kvatlas-server",
            "kvatlas-fleet",
            "kvatlas-proto",
            "kvatlas-events",
            "kvatlas-index",
            "kvatlas-hash",
        ],
    ),
    (
        "kvatlas-bench",
        &[
            "kvatlas-fleet",
            "kvatlas-hash",
            "kvatlas-index",
            "kvatlas-events",
            "kvatlas-proto",
            "kvatlas-server",
        ],
    ),
    ("xtask", &[]),
];

const HASH_ALLOWED_EXTERNAL: &[&str] = &["xxhash-rust"];
const HASH_OPTIONAL_EXTERNAL: &[&str] = &["serde"];
const SANS_RUNTIME: &[&str] = &["kvatlas-index", "kvatlas-events"];
const RUNTIME_CRATES: &[&str] = &["tokio", "tonic", "prost", "hyper", "axum"];
/// What a router importing `kvatlas-proto` must not get.
const PROTO_BANNED: &[&str] = &[
    "kvatlas-index",
    "kvatlas-events",
    "kvatlas-server",
    "axum",
    "zmq",
    "zmq-sys",
    "metrics",
    "prometheus",
    "tracing-subscriber",
];
/// The binary's one source file, and the longest it may be.
const BINARY_MAIN: &str = "crates/kvatlas/src/main.rs";
const BINARY_MAX_LINES: usize = 100;
const LEAVES: &[&str] = &["kvatlas-bench", "xtask"];

pub(crate) fn run(root: &Path) -> Result<()> {
    let metadata = load_metadata(root)?;
    let graph = graph_from_metadata(&metadata)?;
    let mut violations = check_layering(&graph);
    violations.extend(check_patched_copies(
        &patched_copies(&root.join("third_party"))?,
        &package_manifests(&metadata),
    ));
    violations.extend(check_module_docs(&root.join("crates"))?);
    violations.extend(check_proto_tree(&proto_tree(root)?));
    violations.extend(check_thin_binary(root)?);
    if violations.is_empty() {
        eprintln!(
            "tidy: layering, module docs and patched copies OK ({} workspace crates)",
            graph.members.len()
        );
        return Ok(());
    }
    for violation in &violations {
        eprintln!("tidy: {violation}");
    }
    bail!("tidy found {} violation(s)", violations.len())
}

/// Checks rules 1–4 and returns one message per forbidden edge.
pub(crate) fn check_layering(graph: &Graph) -> Vec<String> {
    let mut violations = Vec::new();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED_INTERNAL.iter().copied().collect();

    for edge in &graph.declared {
        let internal_target = graph.members.contains(&edge.to);
        if LEAVES.contains(&edge.to.as_str()) {
            violations.push(format!(
                "forbidden edge {} -> {} ({}): nothing may depend on {}",
                edge.from, edge.to, edge.kind, edge.to
            ));
            continue;
        }
        if internal_target && edge.kind != "build" {
            let ok = allowed
                .get(edge.from.as_str())
                .is_some_and(|list| list.contains(&edge.to.as_str()));
            if !ok {
                violations.push(format!(
                    "forbidden edge {} -> {} ({}): internal crates depend only downwards \
                     (hash <- index <- events <- server)",
                    edge.from, edge.to, edge.kind
                ));
            }
        }
        if edge.from == "kvatlas-hash" && edge.kind == "normal" && !internal_target {
            let plain = HASH_ALLOWED_EXTERNAL.contains(&edge.to.as_str());
            let optional = edge.optional && HASH_OPTIONAL_EXTERNAL.contains(&edge.to.as_str());
            if !plain && !optional {
                violations.push(format!(
                    "forbidden edge kvatlas-hash -> {}: the hash crate may only depend on \
                     xxhash-rust (and an optional serde)",
                    edge.to
                ));
            }
        }
    }

    for krate in SANS_RUNTIME {
        for (runtime, path) in reachable(&graph.resolved_normal, krate, RUNTIME_CRATES) {
            violations.push(format!(
                "forbidden edge {krate} -> {runtime} (via {}): {krate} must not depend on \
                 tokio, tonic, prost or hyper",
                path.join(" -> ")
            ));
        }
    }
    violations
}

/// For each banned name reachable from `start`, one dependency path to it.
fn reachable(
    graph: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    banned: &[&str],
) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    let mut queue = std::collections::VecDeque::from([vec![start.to_string()]]);
    while let Some(path) = queue.pop_front() {
        let Some(last) = path.last() else { continue };
        if !seen.insert(last.clone()) {
            continue;
        }
        if path.len() > 1 && banned.contains(&last.as_str()) {
            found.push((last.clone(), path.clone()));
            continue;
        }
        for next in graph.get(last).into_iter().flatten() {
            let mut longer = path.clone();
            longer.push(next.clone());
            queue.push_back(longer);
        }
    }
    found
}

fn load_metadata(root: &Path) -> Result<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).context("parsing cargo metadata")
}

/// The crates copied under `third_party/` (one folder each, named as the crate).
fn patched_copies(third_party: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    if !third_party.is_dir() {
        return Ok(names);
    }
    for entry in std::fs::read_dir(third_party)
        .with_context(|| format!("reading {}", third_party.display()))?
    {
        let path = entry?.path();
        if path.join("Cargo.toml").is_file()
            && let Some(name) = path.file_name().and_then(|n| n.to_str())
        {
            names.push(name.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Every resolved package as (name, manifest path).
fn package_manifests(metadata: &Value) -> Vec<(String, String)> {
    metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some((
                p.get("name")?.as_str()?.to_string(),
                p.get("manifest_path")?.as_str()?.to_string(),
            ))
        })
        .collect()
}

/// Each crate copied under `third_party/` must be the one the build resolves: a `cargo update`
/// that moves the dependency past the copy's version makes `[patch.crates-io]` silently unused
/// (cargo only warns), and the change would be lost without a failing check.
pub(crate) fn check_patched_copies(
    copies: &[String],
    packages: &[(String, String)],
) -> Vec<String> {
    let mut violations = Vec::new();
    for copy in copies {
        let suffix = format!("third_party/{copy}/Cargo.toml");
        let resolved: Vec<&str> = packages
            .iter()
            .filter(|(name, _)| name == copy)
            .map(|(_, manifest)| manifest.as_str())
            .collect();
        if resolved.is_empty() || resolved.iter().any(|m| !m.ends_with(&suffix)) {
            violations.push(format!(
                "third_party/{copy} is not what the build uses (resolved: {}): the \
                 [patch.crates-io] entry no longer applies; re-apply the change to the new \
                 version as third_party/README.md says",
                if resolved.is_empty() {
                    "nothing".to_string()
                } else {
                    resolved.join(", ")
                }
            ));
        }
    }
    violations
}

fn graph_from_metadata(metadata: &Value) -> Result<Graph> {
    let str_of = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_string);
    let members: BTreeSet<String> = metadata["workspace_members"]
        .as_array()
        .context("workspace_members")?
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect();
    let packages = metadata["packages"].as_array().context("packages")?;
    let id_to_name: BTreeMap<String, String> = packages
        .iter()
        .filter_map(|p| Some((str_of(p, "id")?, str_of(p, "name")?)))
        .collect();

    let mut graph = Graph::default();
    for package in packages {
        let (Some(id), Some(name)) = (str_of(package, "id"), str_of(package, "name")) else {
            continue;
        };
        if !members.contains(&id) {
            continue;
        }
        graph.members.insert(name.clone());
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            graph.declared.push(Edge {
                from: name.clone(),
                to: str_of(dep, "name").unwrap_or_default(),
                kind: str_of(dep, "kind").unwrap_or_else(|| "normal".into()),
                optional: dep["optional"].as_bool().unwrap_or(false),
            });
        }
    }
    for node in metadata["resolve"]["nodes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(name) = str_of(node, "id").and_then(|id| id_to_name.get(&id).cloned()) else {
            continue;
        };
        let deps = graph.resolved_normal.entry(name).or_default();
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null());
            if let (true, Some(target)) = (
                normal,
                str_of(dep, "pkg").and_then(|id| id_to_name.get(&id).cloned()),
            ) {
                deps.insert(target);
            }
        }
    }
    Ok(graph)
}

/// The packages `kvatlas-proto` reaches through normal dependencies when built on its own.
fn proto_tree(root: &Path) -> Result<BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "kvatlas-proto",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--locked",
        ])
        .current_dir(root)
        .output()
        .context("running cargo tree -p kvatlas-proto")?;
    if !output.status.success() {
        bail!(
            "cargo tree -p kvatlas-proto failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

/// Rule 6: what `kvatlas-proto` reaches on its own.
pub(crate) fn check_proto_tree(reached: &BTreeSet<String>) -> Vec<String> {
    reached
        .iter()
        .filter(|name| {
            PROTO_BANNED.contains(&name.as_str())
                || (name.starts_with("kvatlas-")
                    && !matches!(name.as_str(), "kvatlas-proto" | "kvatlas-hash"))
        })
        .map(|name| {
            format!(
                "forbidden edge kvatlas-proto -> {name}: a router importing kvatlas-proto must \
                 get only the generated code, its gRPC runtime and kvatlas-hash"
            )
        })
        .collect()
}

/// Rule 7: the binary is one thin `main.rs`.
fn check_thin_binary(root: &Path) -> Result<Vec<String>> {
    let src = root.join("crates/kvatlas/src");
    let mut violations = Vec::new();
    for entry in std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n != "main.rs") {
            violations.push(format!(
                "{} is in the binary crate: the binary is main.rs alone; put logic in \
                 kvatlas-server",
                path.display()
            ));
        }
    }
    let text = std::fs::read_to_string(root.join(BINARY_MAIN))
        .with_context(|| format!("reading {BINARY_MAIN}"))?;
    violations.extend(check_main(&text));
    Ok(violations)
}

/// Rule 7 on the text of `main.rs`: `main` is its only function, it has no `impl`, and it is
/// short.
pub(crate) fn check_main(text: &str) -> Vec<String> {
    let mut violations = Vec::new();
    let code: Vec<&str> = text
        .lines()
        .map(str::trim_start)
        .filter(|l| !l.starts_with("//"))
        .collect();
    let functions: Vec<&str> = code
        .iter()
        .filter(|l| l.starts_with("fn ") || l.contains(" fn ") || l.starts_with("async fn "))
        .copied()
        .collect();
    if functions.iter().any(|l| !l.starts_with("fn main(")) || functions.len() != 1 {
        violations.push(format!(
            "{BINARY_MAIN} defines functions other than main ({functions:?}): the binary holds no \
             logic; move it to kvatlas_server::cli"
        ));
    }
    if code
        .iter()
        .any(|l| l.starts_with("impl ") || l.starts_with("impl<"))
    {
        violations.push(format!(
            "{BINARY_MAIN} has an impl block: the binary holds no logic"
        ));
    }
    let lines = text.lines().count();
    if lines > BINARY_MAX_LINES {
        violations.push(format!(
            "{BINARY_MAIN} is {lines} lines long; a thin binary stays under {BINARY_MAX_LINES}"
        ));
    }
    violations
}

/// Rule 5: every `.rs` file under `dir` starts with a `//!` doc comment.
fn check_module_docs(dir: &Path) -> Result<Vec<String>> {
    let mut violations = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        for entry in
            std::fs::read_dir(&path).with_context(|| format!("reading {}", path.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                if path
                    .file_name()
                    .is_some_and(|n| n != "target" && n != "generated")
                {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)?;
                if !text.trim_start().starts_with("//!") {
                    violations.push(format!(
                        "{} does not open with a `//!` module doc",
                        path.display()
                    ));
                }
            }
        }
    }
    Ok(violations)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The workspace itself keeps the rules, so a plain `cargo test` enforces the layering too.
    #[test]
    fn the_workspace_keeps_its_layering() {
        if let Err(violations) = run(&crate::workspace_root()) {
            panic!("{violations:#}");
        }
    }

    #[test]
    fn a_patched_copy_that_the_build_does_not_use_is_caught() {
        let copies = vec!["h2".to_string()];
        let used = vec![
            (
                "h2".to_string(),
                "/repo/third_party/h2/Cargo.toml".to_string(),
            ),
            (
                "hyper".to_string(),
                "/registry/hyper-1.12.0/Cargo.toml".to_string(),
            ),
        ];
        assert!(check_patched_copies(&copies, &used).is_empty());
        let upstream = vec![(
            "h2".to_string(),
            "/registry/h2-0.4.21/Cargo.toml".to_string(),
        )];
        let violations = check_patched_copies(&copies, &upstream);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].contains("h2-0.4.21"), "{violations:?}");
        // Both the copy and an upstream version in the graph: the patch misses one user.
        let both = [used.clone(), upstream].concat();
        assert_eq!(check_patched_copies(&copies, &both).len(), 1);
    }

    fn edge(from: &str, to: &str, kind: &str, optional: bool) -> Edge {
        Edge {
            from: from.into(),
            to: to.into(),
            kind: kind.into(),
            optional,
        }
    }

    fn clean_graph() -> Graph {
        let mut graph = Graph {
            members: [
                "kvatlas-hash",
                "kvatlas-index",
                "kvatlas-events",
                "kvatlas-bench",
                "xtask",
            ]
            .map(String::from)
            .into(),
            declared: vec![
                edge("kvatlas-hash", "xxhash-rust", "normal", false),
                edge("kvatlas-hash", "serde", "normal", true),
                edge("kvatlas-hash", "proptest", "dev", false),
                edge("kvatlas-index", "kvatlas-hash", "normal", false),
                edge("kvatlas-events", "kvatlas-index", "normal", false),
                edge("kvatlas-bench", "kvatlas-index", "normal", false),
            ],
            ..Graph::default()
        };
        for (from, to) in [
            ("kvatlas-hash", "xxhash-rust"),
            ("kvatlas-index", "kvatlas-hash"),
            ("kvatlas-index", "dashmap"),
            ("kvatlas-events", "kvatlas-index"),
            ("kvatlas-bench", "tokio"),
        ] {
            graph
                .resolved_normal
                .entry(from.into())
                .or_default()
                .insert(to.into());
        }
        graph
    }

    #[test]
    fn clean_graph_passes() {
        assert_eq!(check_layering(&clean_graph()), Vec::<String>::new());
    }

    #[test]
    fn catches_a_runtime_reached_transitively_from_the_index() {
        let mut graph = clean_graph();
        graph
            .resolved_normal
            .entry("dashmap".into())
            .or_default()
            .insert("tokio".into());
        let violations = check_layering(&graph);
        assert_eq!(violations.len(), 2, "{violations:?}"); // index and events (through index)
        assert!(
            violations[0].contains("forbidden edge kvatlas-index -> tokio"),
            "{violations:?}"
        );
        assert!(
            violations[0].contains("kvatlas-index -> dashmap -> tokio"),
            "{violations:?}"
        );
    }

    #[test]
    fn catches_an_upward_internal_edge_and_a_dependency_on_the_bench_crate() {
        let mut graph = clean_graph();
        graph
            .declared
            .push(edge("kvatlas-index", "kvatlas-events", "normal", false));
        graph
            .declared
            .push(edge("kvatlas-events", "kvatlas-bench", "dev", false));
        let violations = check_layering(&graph);
        assert!(
            violations
                .iter()
                .any(|v| v.starts_with("forbidden edge kvatlas-index -> kvatlas-events"))
        );
        assert!(
            violations
                .iter()
                .any(|v| v.starts_with("forbidden edge kvatlas-events -> kvatlas-bench (dev)"))
        );
    }

    #[test]
    fn catches_an_extra_dependency_of_the_hash_crate() {
        let mut graph = clean_graph();
        graph
            .declared
            .push(edge("kvatlas-hash", "bytemuck", "normal", false));
        graph
            .declared
            .push(edge("kvatlas-hash", "xxhash-rust", "normal", true)); // optional is fine
        let violations = check_layering(&graph);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].starts_with("forbidden edge kvatlas-hash -> bytemuck"));
    }

    #[test]
    fn the_proto_crate_reaches_only_hash_and_its_runtime() {
        let clean: BTreeSet<String> = ["kvatlas-proto", "kvatlas-hash", "tonic", "prost", "tokio"]
            .map(String::from)
            .into();
        assert_eq!(check_proto_tree(&clean), Vec::<String>::new());
        let mut dirty = clean;
        dirty.extend(["axum", "kvatlas-index", "kvatlas-future"].map(String::from));
        let violations = check_proto_tree(&dirty);
        assert_eq!(violations.len(), 3, "{violations:?}");
        assert!(
            violations
                .iter()
                .any(|v| v.contains("kvatlas-proto -> axum"))
        );
    }

    #[test]
    fn the_binary_must_stay_thin() {
        let thin = "//! doc\nuse clap::Parser;\nfn main() -> ExitCode {\n    run()\n}\n";
        assert_eq!(check_main(thin), Vec::<String>::new());
        let helper = format!("{thin}fn helper() {{}}\n");
        assert_eq!(check_main(&helper).len(), 1);
        let method = format!("{thin}impl Cli {{\n    pub fn go(&self) {{}}\n}}\n");
        assert_eq!(check_main(&method).len(), 2, "{:?}", check_main(&method));
        let long = format!("{thin}{}", "// line\n".repeat(BINARY_MAX_LINES));
        assert_eq!(check_main(&long).len(), 1);
    }

    #[test]
    fn serde_must_stay_optional_in_the_hash_crate() {
        let mut graph = clean_graph();
        graph
            .declared
            .push(edge("kvatlas-hash", "serde", "normal", false));
        let violations = check_layering(&graph);
        assert!(
            violations
                .iter()
                .any(|v| v.starts_with("forbidden edge kvatlas-hash -> serde"))
        );
    }
}
