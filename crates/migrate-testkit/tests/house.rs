//! Two rules of the house, checked over every crate's `src/` (`crates/*/src/**/*.rs`):
//!
//! - **No circle of files.** A file imports another when it names one of the other's items: a
//!   `use crate::..`, `use super::..`, `use self::..` or `use child::..`, or such a path
//!   written in code (`crate::wire::Hello`, `super::Arrival`, `$crate::..` in a macro). A
//!   path is followed to the file that defines what it names: through the modules (`a/b.rs` or
//!   `a/b/mod.rs`, or the file an inline `mod b { .. }` sits in) and through the `use`s of the
//!   module it lands in, so `crate::Control` is an import of `control.rs`, not of `lib.rs`.
//!   A module's `mod child;` is not an import of the child; its `pub use child::Item` is, and
//!   so is a path in a test module. Comments (doc links too) and strings are not. A circle is
//!   a cycle in that graph (a file importing itself does not count); each one is reported
//!   with its files and the lines that close it.
//! - **No source file over [`MAX_LINES`] lines.**
//!
//! An exception, when one must be let through, is listed below with the reason and the work
//! that removes it; today there is none.
//! The scan is a small lexer (comments, strings and char literals skipped, braces counted for
//! inline modules), not a Rust parser: it needs nothing but std and reads the tree in
//! milliseconds.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A file past a few hundred lines holds more than one concern (STYLE.md 9); 700 leaves room
/// for a module with its doc, its error type and its table tests.
const MAX_LINES: usize = 700;

/// Circles known and being removed, each with why: a circle found is let through only when
/// every one of its files is in one entry (an entry ending in `/` stands for every file under
/// it). A new circle, or a file that joins a known one, fails. Delete an entry with the work
/// that removes its circle.
const KNOWN_CIRCLES: &[(&str, &[&str])] = &[];

fn known(circle: &Circle) -> bool {
    KNOWN_CIRCLES.iter().any(|(_, files)| {
        circle.files.iter().all(|f| {
            files
                .iter()
                .any(|k| f == k || (k.ends_with('/') && f.starts_with(k)))
        })
    })
}

/// Files allowed past [`MAX_LINES`], each with why. Delete an entry once its file is split.
const LONG_FILES_ALLOWED: &[(&str, &str)] = &[];

#[test]
fn no_file_imports_itself_through_a_circle() {
    let tree = Tree::read(&workspace_crates());
    let circles: Vec<String> = tree
        .circles()
        .into_iter()
        .filter(|circle| !known(circle))
        .map(|circle| circle.describe())
        .collect();
    assert!(
        circles.is_empty(),
        "{} circle(s) of files that import each other; move what both sides use a floor \
         below them:\n\n{}",
        circles.len(),
        circles.join("\n")
    );
}

#[test]
fn no_source_file_is_over_the_limit() {
    let tree = Tree::read(&workspace_crates());
    let long: Vec<String> = tree
        .lines
        .iter()
        .filter(|(name, lines)| {
            **lines > MAX_LINES && !LONG_FILES_ALLOWED.iter().any(|(f, _)| f == name)
        })
        .map(|(name, lines)| format!("  {name}: {lines} lines"))
        .collect();
    assert!(
        long.is_empty(),
        "source files over {MAX_LINES} lines; split each by concern into sibling modules \
         (tests may move to a tests.rs beside it):\n{}",
        long.join("\n")
    );
}

/// The checker checks: a circle made on purpose is found, with both files and both lines.
#[test]
fn a_made_up_circle_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("crates/toy/src");
    fs::create_dir_all(src.join("side")).unwrap();
    let write = |name: &str, text: &str| fs::write(src.join(name), text).unwrap();
    write("lib.rs", "mod side;\nmod shared;\npub use side::Thing;\n");
    write("shared.rs", "pub struct Floor;\n");
    write(
        "side/mod.rs",
        "mod worker;\npub use worker::Thing;\npub struct Up;\nuse crate::shared::Floor;\n",
    );
    // The worker reaches its parent through a path in code, the parent re-exports the worker.
    write(
        "side/worker.rs",
        "// use super::Up; (a comment is no import)\npub struct Thing(crate::side::Up);\n\
         const S: &str = \"super::Up\";\n",
    );
    let tree = Tree::read(&[dir.path().join("crates/toy")]);
    let circles = tree.circles();
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert_eq!(
        circles[0].files,
        [
            "crates/toy/src/side/mod.rs",
            "crates/toy/src/side/worker.rs"
        ]
    );
    let text = circles[0].describe();
    assert!(
        text.contains("side/mod.rs:2 -> crates/toy/src/side/worker.rs"),
        "{text}"
    );
    assert!(
        text.contains("side/worker.rs:2 -> crates/toy/src/side/mod.rs"),
        "{text}"
    );

    // Moving the shared piece down a floor breaks it.
    write(
        "side/worker.rs",
        "pub struct Thing(crate::shared::Floor);\n",
    );
    assert!(
        Tree::read(&[dir.path().join("crates/toy")])
            .circles()
            .is_empty()
    );
}

/// The workspace's crates, found from this crate's own directory.
fn workspace_crates() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found: Vec<PathBuf> = fs::read_dir(crates)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.join("src").is_dir())
        .collect();
    found.sort();
    assert!(
        found.len() > 1,
        "no crates found beside {}",
        crates.display()
    );
    found
}

/// One circle: its files (sorted) and the imports between them.
#[derive(Debug)]
struct Circle {
    files: Vec<String>,
    /// (from, line, to)
    edges: Vec<(String, usize, String)>,
}

impl Circle {
    fn describe(&self) -> String {
        let mut text = format!(
            "circle of {} files: {}\n",
            self.files.len(),
            self.files.join(", ")
        );
        for (from, line, to) in &self.edges {
            text.push_str(&format!("    {from}:{line} -> {to}\n"));
        }
        text
    }
}

/// A module: the file it lives in, and the names its `use`s bring in (name -> absolute path).
#[derive(Debug, Default)]
struct Module {
    file: String,
    imports: BTreeMap<String, Vec<String>>,
}

/// A path written in a file, made absolute (from its crate's root).
#[derive(Debug)]
struct Reference {
    file: String,
    line: usize,
    path: Vec<String>,
}

/// Every crate's modules, keyed by (crate, module path), and every reference.
#[derive(Debug, Default)]
struct Tree {
    modules: BTreeMap<(String, Vec<String>), Module>,
    references: Vec<(String, Reference)>,
    /// Every `.rs` file under a `src/` (reached from a root or not) with its line count.
    lines: BTreeMap<String, usize>,
    /// What names are relative to: the path of the workspace root, with a trailing `/`.
    base: String,
}

impl Tree {
    fn read(crate_dirs: &[PathBuf]) -> Tree {
        let base = crate_dirs[0].parent().unwrap().parent().unwrap();
        let mut tree = Tree {
            base: format!("{}/", base.display()),
            ..Tree::default()
        };
        for dir in crate_dirs {
            let src = dir.join("src");
            for file in rust_files(&src) {
                let lines = fs::read_to_string(&file).unwrap().lines().count();
                tree.lines.insert(tree.name(&file), lines);
            }
            let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
                .iter()
                .map(|root| src.join(root))
                .filter(|root| root.is_file())
                .collect();
            if let Ok(bins) = fs::read_dir(src.join("bin")) {
                roots.extend(bins.map(|entry| entry.unwrap().path()));
            }
            for root in roots {
                let krate = tree.name(&root);
                tree.read_module(&krate, &root, &src, Vec::new());
            }
        }
        tree
    }

    fn name(&self, path: &Path) -> String {
        let full = path.display().to_string();
        full.strip_prefix(&self.base).unwrap_or(&full).to_string()
    }

    /// Reads the file of module `path` (its children's files live in `dir`), then its children.
    fn read_module(&mut self, krate: &str, file: &Path, dir: &Path, path: Vec<String>) {
        let name = self.name(file);
        let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{name}: {e}"));
        let scanned = scan(&tokens(&text), &path);
        for (module, imports) in scanned.imports {
            let entry = self.modules.entry((krate.to_string(), module)).or_default();
            entry.file = name.clone();
            entry.imports.extend(imports);
        }
        self.modules
            .entry((krate.to_string(), path.clone()))
            .or_default()
            .file = name.clone();
        for (line, reference) in scanned.references {
            self.references.push((
                krate.to_string(),
                Reference {
                    file: name.clone(),
                    line,
                    path: reference,
                },
            ));
        }
        for child in scanned.children {
            // `mod b;` inside an inline `mod a { .. }` lives in dir/a/b.rs.
            let mut child_dir = dir.to_path_buf();
            for inline in &child[path.len()..child.len() - 1] {
                child_dir.push(inline);
            }
            let last = child.last().unwrap();
            let (child_file, grandchildren) = if child_dir.join(format!("{last}.rs")).is_file() {
                (child_dir.join(format!("{last}.rs")), child_dir.join(last))
            } else {
                (child_dir.join(last).join("mod.rs"), child_dir.join(last))
            };
            self.read_module(krate, &child_file, &grandchildren, child);
        }
    }

    /// The file that defines what an absolute path names.
    fn resolve(&self, krate: &str, path: &[String], depth: usize) -> Option<&str> {
        let key = |len: usize| (krate.to_string(), path[..len].to_vec());
        let len = (0..=path.len())
            .rev()
            .find(|len| self.modules.contains_key(&key(*len)))?;
        let module = &self.modules[&key(len)];
        if let Some(name) = path.get(len)
            && let Some(target) = module.imports.get(name)
            && depth < 16
        {
            let mut followed = target.clone();
            followed.extend_from_slice(&path[len + 1..]);
            if let Some(file) = self.resolve(krate, &followed, depth + 1) {
                return Some(file);
            }
        }
        Some(&module.file)
    }

    /// The import graph: file -> (file -> first line that imports it).
    fn graph(&self) -> BTreeMap<&str, BTreeMap<&str, usize>> {
        let mut graph: BTreeMap<&str, BTreeMap<&str, usize>> = BTreeMap::new();
        for (krate, reference) in &self.references {
            let Some(to) = self.resolve(krate, &reference.path, 0) else {
                continue;
            };
            if to != reference.file {
                let line = graph
                    .entry(&reference.file)
                    .or_default()
                    .entry(to)
                    .or_insert(reference.line);
                *line = (*line).min(reference.line);
            }
        }
        graph
    }

    /// Every strongly connected set of two or more files (Tarjan), with the edges inside it.
    fn circles(&self) -> Vec<Circle> {
        let graph = self.graph();
        let nodes: BTreeSet<&str> = graph
            .iter()
            .flat_map(|(from, tos)| std::iter::once(*from).chain(tos.keys().copied()))
            .collect();
        let nodes: Vec<&str> = nodes.into_iter().collect();
        let index_of: BTreeMap<&str, usize> =
            nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let edges: Vec<Vec<usize>> = nodes
            .iter()
            .map(|n| {
                graph
                    .get(n)
                    .map(|tos| tos.keys().map(|t| index_of[t]).collect())
                    .unwrap_or_default()
            })
            .collect();
        let mut circles = Vec::new();
        for component in strongly_connected(&edges) {
            if component.len() < 2 {
                continue;
            }
            let mut files: Vec<String> = component.iter().map(|i| nodes[*i].to_string()).collect();
            files.sort();
            let mut inside = Vec::new();
            for from in &files {
                for (to, line) in graph.get(from.as_str()).into_iter().flatten() {
                    if files.iter().any(|f| f == to) {
                        inside.push((from.clone(), *line, to.to_string()));
                    }
                }
            }
            circles.push(Circle {
                files,
                edges: inside,
            });
        }
        circles.sort_by(|a, b| a.files.cmp(&b.files));
        circles
    }
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Tarjan's algorithm, iterative: the strongly connected components of a graph.
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = edges.len();
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut stack = Vec::new();
    let mut components = Vec::new();
    let mut next = 0;
    for start in 0..n {
        if index[start] != usize::MAX {
            continue;
        }
        // (node, next edge to look at)
        let mut work = vec![(start, 0)];
        while let Some(&(v, edge)) = work.last() {
            if edge == 0 && index[v] == usize::MAX {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = edges[v].get(edge) {
                work.last_mut().unwrap().1 += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                loop {
                    let w = stack.pop().unwrap();
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                components.push(component);
            }
        }
    }
    components
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Rust source as identifiers and punctuation with their line; comments, strings, chars,
/// lifetimes and numbers left out.
fn tokens(text: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else if i >= chars.len() {
                    break;
                } else {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
            }
        } else if c == '"' || ((c == 'b' || c == 'c') && at(i + 1) == '"') {
            i += if c == '"' { 1 } else { 2 };
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                line += usize::from(at(i) == '\n');
                i += 1;
            }
            i += 1;
        } else if (c == 'r' && (at(i + 1) == '"' || at(i + 1) == '#'))
            || ((c == 'b' || c == 'c') && at(i + 1) == 'r' && matches!(at(i + 2), '"' | '#'))
        {
            // A raw string, r#"..."#; `r#ident` is a raw identifier.
            let mut j = i + if c == 'r' { 1 } else { 2 };
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            if at(j) != '"' {
                // r#ident
                let start = j;
                while at(j).is_alphanumeric() || at(j) == '_' {
                    j += 1;
                }
                out.push((Token::Ident(chars[start..j].iter().collect()), line));
                i = j;
                continue;
            }
            j += 1;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (0..hashes).all(|k| at(j + 1 + k) == '#') {
                    j += 1 + hashes;
                    break;
                }
                line += usize::from(chars[j] == '\n');
                j += 1;
            }
            i = j;
        } else if c == '\'' || (c == 'b' && at(i + 1) == '\'') {
            let q = if c == 'b' { i + 1 } else { i };
            if at(q + 1) == '\\' {
                // '\n', '\u{..}', '\''
                let mut j = q + 2;
                while j < chars.len() && chars[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if at(q + 2) == '\'' {
                i = q + 3;
            } else {
                // A lifetime or a label.
                let mut j = q + 1;
                while at(j).is_alphanumeric() || at(j) == '_' {
                    j += 1;
                }
                i = j;
            }
        } else if c.is_ascii_digit() {
            while at(i).is_alphanumeric()
                || at(i) == '_'
                || (at(i) == '.' && at(i + 1).is_ascii_digit())
            {
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            out.push((Token::Ident(chars[start..i].iter().collect()), line));
        } else if c == ':' && at(i + 1) == ':' {
            out.push((Token::Path, line));
            i += 2;
        } else {
            out.push((Token::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// What one file says about modules: the module paths its inline modules and `mod x;`
/// declare, the names its `use`s bring in per module, and every path it writes.
#[derive(Debug, Default)]
struct Scanned {
    /// `mod x;` declarations, as absolute module paths.
    children: Vec<Vec<String>>,
    /// module path -> (name -> absolute path), for the file's module and its inline modules.
    imports: BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>,
    /// (line, absolute path)
    references: Vec<(usize, Vec<String>)>,
}

/// A path as a file writes it.
#[derive(Debug)]
struct Written {
    line: usize,
    /// The module it is written in.
    scope: Vec<String>,
    segments: Vec<String>,
    /// The name a `use` binds to it (`None` for a glob, `_`, or a path in code).
    binds: Option<String>,
}

fn ident(token: Option<&(Token, usize)>) -> Option<&str> {
    match token {
        Some((Token::Ident(name), _)) => Some(name),
        _ => None,
    }
}

/// Scans the tokens of the file of module `module`.
fn scan(tokens: &[(Token, usize)], module: &[String]) -> Scanned {
    let mut scanned = Scanned::default();
    scanned.imports.insert(module.to_vec(), BTreeMap::new());
    // The modules declared in this file (inline or not): a path may start with one of them.
    let mut declared: BTreeSet<Vec<String>> = BTreeSet::new();
    // (module path, brace depth its body is at)
    let mut scopes: Vec<(Vec<String>, usize)> = vec![(module.to_vec(), 0)];
    let mut depth = 0;
    // Paths as written, made absolute once every module of the file is known.
    let mut written: Vec<Written> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let scope = scopes.last().unwrap().0.clone();
        match &tokens[i].0 {
            Token::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Token::Punct('}') => {
                depth -= 1;
                while scopes.len() > 1 && scopes.last().unwrap().1 > depth {
                    scopes.pop();
                }
                i += 1;
            }
            Token::Ident(word) if word == "mod" => {
                if let Some(name) = ident(tokens.get(i + 1)) {
                    let mut child = scope.clone();
                    child.push(name.to_string());
                    declared.insert(child.clone());
                    match tokens.get(i + 2) {
                        Some((Token::Punct(';'), _)) => scanned.children.push(child),
                        Some((Token::Punct('{'), _)) => {
                            depth += 1;
                            scanned.imports.entry(child.clone()).or_default();
                            scopes.push((child, depth));
                            i += 1;
                        }
                        _ => {}
                    }
                    i += 2;
                } else {
                    i += 1;
                }
            }
            Token::Ident(word) if word == "use" => {
                let line = tokens[i].1;
                let mut trees = Vec::new();
                i = use_tree(tokens, i + 1, Vec::new(), &mut trees);
                for (segments, binds) in trees {
                    written.push(Written {
                        line,
                        scope: scope.clone(),
                        segments,
                        binds,
                    });
                }
            }
            Token::Ident(word)
                if tokens.get(i + 1).map(|t| &t.0) == Some(&Token::Path)
                    && !(i > 0 && tokens[i - 1].0 == Token::Path)
                    && !(i > 0 && ident(tokens.get(i - 1)) == Some("in")) =>
            {
                let line = tokens[i].1;
                let dollar = i > 0 && tokens[i - 1].0 == Token::Punct('$');
                let mut segments = vec![if dollar && word == "crate" {
                    "crate".to_string()
                } else {
                    word.clone()
                }];
                let mut j = i + 1;
                while tokens.get(j).map(|t| &t.0) == Some(&Token::Path) {
                    match ident(tokens.get(j + 1)) {
                        Some(next) => segments.push(next.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                written.push(Written {
                    line,
                    scope: scope.clone(),
                    segments,
                    binds: None,
                });
                i = j;
            }
            _ => i += 1,
        }
    }
    // The `use`s first: a path in code may start with a name one of them binds.
    written.sort_by_key(|w| w.binds.is_none());
    for Written {
        line,
        scope,
        segments,
        binds,
    } in written
    {
        let bound = scanned
            .imports
            .get(&scope)
            .and_then(|names| segments.first().and_then(|first| names.get(first)));
        let path = match bound {
            Some(import) if binds.is_none() => {
                let mut path = import.clone();
                path.extend_from_slice(&segments[1..]);
                path
            }
            _ => match absolute(&scope, &segments, &declared) {
                Some(path) => path,
                None => continue,
            },
        };
        if let Some(name) = binds {
            scanned
                .imports
                .entry(scope)
                .or_default()
                .insert(name, path.clone());
        }
        scanned.references.push((line, path));
    }
    scanned
}

/// Reads one use tree from `i`: every leaf as (segments, the name it binds; None for a glob or
/// `_`). Returns the index after it.
fn use_tree(
    tokens: &[(Token, usize)],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    if tokens.get(i).map(|t| &t.0) == Some(&Token::Path) {
        i += 1; // `use ::std::..`
    }
    loop {
        match tokens.get(i).map(|t| &t.0) {
            Some(Token::Ident(name)) => {
                let name = name.clone();
                i += 1;
                if tokens.get(i).map(|t| &t.0) == Some(&Token::Path) {
                    prefix.push(name);
                    i += 1;
                    continue;
                }
                let mut binds = if name == "self" {
                    prefix.last().cloned()
                } else {
                    Some(name.clone())
                };
                if name != "self" {
                    prefix.push(name);
                }
                if ident(tokens.get(i)) == Some("as") {
                    binds = ident(tokens.get(i + 1))
                        .filter(|n| *n != "_")
                        .map(String::from);
                    i += 2;
                }
                out.push((prefix, binds));
                return i;
            }
            Some(Token::Punct('*')) => {
                out.push((prefix, None));
                return i + 1;
            }
            Some(Token::Punct('{')) => {
                i += 1;
                loop {
                    match tokens.get(i).map(|t| &t.0) {
                        Some(Token::Punct('}')) => return i + 1,
                        Some(Token::Punct(',')) => i += 1,
                        None => return i,
                        _ => i = use_tree(tokens, i, prefix.clone(), out),
                    }
                }
            }
            _ => return i,
        }
    }
}

/// A path written in module `scope`, from its crate's root; `None` for another crate's.
fn absolute(
    scope: &[String],
    segments: &[String],
    declared: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let first = segments.first()?;
    let mut path: Vec<String>;
    let mut rest = segments;
    match first.as_str() {
        "crate" => {
            path = Vec::new();
            rest = &segments[1..];
        }
        "self" => {
            path = scope.to_vec();
            rest = &segments[1..];
        }
        "super" => {
            path = scope.to_vec();
            while rest.first().map(String::as_str) == Some("super") {
                path.pop();
                rest = &rest[1..];
            }
        }
        _ => {
            let mut child = scope.to_vec();
            child.push(first.clone());
            if !declared.contains(&child) {
                return None;
            }
            path = scope.to_vec();
        }
    }
    path.extend(rest.iter().cloned());
    Some(path)
}
