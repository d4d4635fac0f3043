//! docs/grafana/weir.json queries only metrics weir exports: every metric
//! name in every PromQL expression (panels and template variables) is
//! checked against a running daemon's /metrics, so renaming a metric
//! without updating the dashboard fails here.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;
use weir::config::Config;

mod daemon_util;
use daemon_util::Echo;
use daemon_util::admin::Running;

/// Metric names a /metrics scrape offers: every sample's name, and for
/// families without samples yet (e.g. refusals by a reason that never
/// happened) the name their `# TYPE` line implies.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (Some(name), Some(kind)) = (it.next(), it.next()) else {
                continue;
            };
            match kind {
                "counter" => names.insert(format!("{name}_total")),
                _ => names.insert(name.to_owned()),
            };
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    names
}

/// Label names on the samples of `metric` in a scrape.
fn labels_of(text: &str, metric: &str) -> BTreeSet<String> {
    let mut labels = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some(end) = rest.find('}') else { continue };
        for pair in rest[..end].split(',') {
            if let Some((k, _)) = pair.split_once('=') {
                labels.insert(k.trim().to_owned());
            }
        }
    }
    labels
}

/// Words of PromQL that are not metric names when not followed by `(`:
/// operators, and aggregations written `sum by (l) (...)`.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Clauses whose parenthesised list holds label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names in one PromQL expression: identifiers that are not
/// functions, keywords, label lists, label matchers (`{...}`), ranges
/// (`[...]`), strings or Grafana variables (`$x`).
fn metric_names(expr: &str) -> Vec<String> {
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    // Index just past the bracket that closes the one opened at `open`,
    // skipping quoted strings inside.
    let skip_group = |open: usize, close: u8| -> usize {
        let mut j = open + 1;
        let mut depth = 1;
        while j < b.len() {
            match b[j] {
                b'"' | b'\'' | b'`' => {
                    let q = b[j];
                    j += 1;
                    while j < b.len() && b[j] != q {
                        j += if b[j] == b'\\' { 2 } else { 1 };
                    }
                }
                c if c == b[open] => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return j + 1;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        panic!("unbalanced {} in {expr}", b[open] as char);
    };
    while i < b.len() {
        match b[i] {
            b'{' => i = skip_group(i, b'}'),
            b'[' => i = skip_group(i, b']'),
            b'"' | b'\'' | b'`' => {
                let q = b[i];
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'$' => {
                i += 1;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == b'.' => {
                while i < b.len() && (ident(b[i]) || b[i] == b'.') {
                    i += 1;
                }
            }
            c if ident(c) => {
                let start = i;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let mut j = i;
                while j < b.len() && b[j].is_ascii_whitespace() {
                    j += 1;
                }
                let call = j < b.len() && b[j] == b'(';
                if LABEL_LISTS.contains(&word) {
                    if call {
                        i = skip_group(j, b')');
                    }
                } else if !call && !KEYWORDS.contains(&word) {
                    out.push(word.to_owned());
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Every (where, PromQL) of the dashboard: panel targets' `expr` and the
/// template variables' `label_values(EXPR, LABEL)` queries, the label
/// returned alongside.
fn queries(dash: &Value) -> Vec<(String, String, Option<String>)> {
    let mut out = Vec::new();
    let mut stack: Vec<&Value> = dash["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = stack.pop() {
        if let Some(inner) = p["panels"].as_array() {
            stack.extend(inner);
        }
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("a target without expr");
            out.push((format!("panel {:?}", p["title"]), expr.to_owned(), None));
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .expect("a query variable without a query");
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: not label_values(..): {q}", v["name"]));
        let (metric, label) = inner.rsplit_once(',').unwrap();
        out.push((
            format!("variable {}", v["name"]),
            metric.trim().to_owned(),
            Some(label.trim().to_owned()),
        ));
    }
    out
}

#[test]
fn the_extractor_finds_metric_names_only() {
    assert_eq!(
        metric_names(
            r#"sum by (tenant, reason) (rate(a_total{x="}{[", y=~"$v"}[$__rate_interval] offset 5m)) / on (tenant) group_left (service) b or vector(0) > bool 1.5e3"#
        ),
        ["a_total", "b"]
    );
    assert_eq!(metric_names("-c_bytes_per_second"), ["c_bytes_per_second"]);
}

#[test]
fn every_dashboard_query_names_an_exported_metric() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/grafana/weir.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));

    // A daemon with a tenant that has its own table and a service with
    // two backends, so every per-tenant/service/backend family has samples.
    let (e1, e2) = (Echo::start(), Echo::start());
    let cfg: Config = toml::from_str(&format!(
        "[daemon]\nworkers = 1\n[[tenant]]\nname = \"acme\"\ntable_entries = 1024\n\
         [[service]]\ntenant = \"acme\"\nname = \"web\"\nprotocol = \"tcp\"\n\
         listen = \"127.0.0.1:0\"\nscheduler = \"rr\"\n\
         [[service.backend]]\naddress = \"{}\"\n[[service.backend]]\naddress = \"{}\"\n",
        e1.addr, e2.addr
    ))
    .unwrap();
    let r = Running::start(cfg, None);
    let text = r
        .client
        .call("GET", "/metrics", None)
        .expect("GET /metrics");
    r.shutdown();

    let have = exported(&text);
    let mut used = BTreeSet::new();
    let mut missing = Vec::new();
    let all = queries(&dash);
    assert!(all.len() >= 20, "only {} queries found", all.len());
    for (place, expr, label) in &all {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{place}: no metric in {expr}");
        for n in names {
            if !have.contains(&n) {
                missing.push(format!("{place}: {n} (in {expr})"));
            }
            if let Some(l) = label
                && !labels_of(&text, &n).contains(l)
            {
                missing.push(format!("{place}: {n} has no label {l}"));
            }
            used.insert(n);
        }
    }
    assert!(
        missing.is_empty(),
        "the dashboard queries what weir does not export:\n  {}\nexported: {have:?}",
        missing.join("\n  ")
    );
    // The issue's topics are each on the dashboard.
    for topic in [
        "weir_service_connections_per_second",
        "weir_backend_connections_per_second",
        "weir_refused_connections_total",
        "weir_table_entries",
        "weir_backend_up",
    ] {
        assert!(used.contains(topic), "the dashboard does not show {topic}");
    }
}
