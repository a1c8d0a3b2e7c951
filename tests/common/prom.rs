//! A strict reader of the Prometheus text format (written for the tests, independent of the
//! exporter), and a plain HTTP scrape.

use std::collections::BTreeMap;
use std::io::{Read, Write};

#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

/// Parses an exposition; any malformed line is an error naming it.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let f: Vec<&str> = rest.split_whitespace().collect();
            match f.first() {
                Some(&"TYPE")
                    if f.len() == 3
                        && valid_name(f[1])
                        && ["counter", "gauge", "histogram", "summary", "untyped"]
                            .contains(&f[2]) => {}
                Some(&"HELP") if f.len() >= 2 && valid_name(f[1]) => {}
                _ => return Err(format!("bad comment line: {line}")),
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').ok_or(format!("no value: {line}"))?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().map_err(|_| format!("bad value in: {line}"))?,
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .ok_or(format!("unclosed labels: {line}"))?;
                let mut labels = BTreeMap::new();
                let mut s = body;
                while !s.is_empty() {
                    let (k, r) = s.split_once("=\"").ok_or(format!("bad label in: {line}"))?;
                    let end = r
                        .find('"')
                        .ok_or(format!("unterminated label in: {line}"))?;
                    if !valid_name(k) {
                        return Err(format!("bad label name '{k}' in: {line}"));
                    }
                    labels.insert(k.to_string(), r[..end].to_string());
                    s = r[end + 1..].trim_start_matches(',');
                }
                (name, labels)
            }
        };
        if !valid_name(name) {
            return Err(format!("bad metric name in: {line}"));
        }
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(out)
}

/// GET /metrics over plain HTTP/1.1.
pub fn scrape(addr: &str) -> Vec<Sample> {
    let text = scrape_text(addr);
    parse(&text).unwrap_or_else(|e| panic!("{addr}/metrics is not Prometheus text: {e}"))
}

/// The text of `addr`/metrics.
pub fn scrape_text(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let (head, text) = body.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    text.to_string()
}

/// Sum of the samples named `name` whose labels include every `(key, value)` of `with`.
pub fn sum(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| {
            s.name == name
                && with
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        })
        .map(|s| s.value)
        .sum()
}
