//! Every malformed request the service can receive, and what it answers. The README's table is
//! this list (a test keeps them in step), and `tests/service.rs` sends each case.

use tonic::Code;

pub struct BadInput {
    /// A short name for the case (tests key their requests by it).
    pub case: &'static str,
    pub code: Code,
    /// A fragment every answer to this case contains.
    pub message: &'static str,
}

const fn bad(case: &'static str, message: &'static str) -> BadInput {
    BadInput {
        case,
        code: Code::InvalidArgument,
        message,
    }
}

pub const BAD_INPUT: &[BadInput] = &[
    bad("no hidden_states", "hidden_states is required"),
    bad(
        "hidden size other than the model's",
        "does not match the model's",
    ),
    bad("shape not [n, hidden]", "must be [n, "),
    bad("zero tokens", "no tokens"),
    bad(
        "bytes not matching shape and dtype",
        "bytes of data for shape",
    ),
    bad("dtype number outside the enum", "unknown dtype"),
    bad(
        "integer hidden states or weights, float ids",
        "not accepted here",
    ),
    bad(
        "NaN or infinity in hidden states or weights",
        "non-finite value at row",
    ),
    bad(
        "layer that is not an MoE layer",
        "is not an MoE layer of this model",
    ),
    bad("expert id outside 0..E", "is out of range 0.."),
    bad("an expert twice in one row", "repeated in row"),
    bad("topk_ids or topk_weights not [n, top_k]", "must be ["),
    bad(
        "topk_weights without topk_ids",
        "topk_weights given without topk_ids",
    ),
    bad(
        "topk_ids without topk_weights",
        "topk_ids given without topk_weights",
    ),
    bad("output_dtype not a float dtype", "is not a float dtype"),
    BadInput {
        case: "message over --max-request-bytes",
        code: Code::OutOfRange,
        message: "decoded message length too large",
    },
    BadInput {
        case: "more tokens than --max-queued-tokens",
        code: Code::ResourceExhausted,
        message: "exceeds --max-queued-tokens",
    },
];

#[cfg(test)]
mod tests {
    #[test]
    fn the_readme_lists_every_case() {
        let readme = include_str!("../../README.md");
        for b in super::BAD_INPUT {
            let row = readme
                .lines()
                .find(|l| l.starts_with(&format!("| {} |", b.case)))
                .unwrap_or_else(|| panic!("README has no row for '{}'", b.case));
            let code = format!("{:?}", b.code);
            assert!(
                row.contains(b.message),
                "README row for '{}' lacks '{}'",
                b.case,
                b.message
            );
            let upper = code_name(&code);
            assert!(
                row.contains(&upper),
                "README row for '{}' lacks {upper}",
                b.case
            );
        }
    }

    /// `InvalidArgument` → `INVALID_ARGUMENT`.
    fn code_name(camel: &str) -> String {
        let mut out = String::new();
        for (i, c) in camel.chars().enumerate() {
            if c.is_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_uppercase());
        }
        out
    }
}
