//! Where an allocation was made, as a site that reads the same from one run, machine or
//! virtual environment to another (issue 61): explain's groups name it, and two runs' sites
//! match by it.
//!
//! A stack's site is, innermost first:
//! 1. its innermost frame in the program's own code (a Python file outside torch, not one
//!    that `torch.compile` generated: those are named by the program's line that ran them,
//!    and their lines differ with every compilation);
//! 2. else its innermost Python frame that was not generated (torch's own:
//!    `torch/nn/modules/linear.py:125 in forward`);
//! 3. else, for a stack of C++ frames only (about half of a training step's allocations: the
//!    autograd engine's backward work, on its own thread), the autograd node and the
//!    operator that allocated (`backward: MeanBackward0 (aten::div_Scalar)`), or either
//!    alone;
//! 4. else its innermost frame in code `torch.compile` generated, else its innermost frame
//!    as written, or `(no stack recorded)`. No allocation is left without a site.
//!
//! A site's file and the rest are each at most [`MAX_SITE_PART_BYTES`] (a longer one is cut
//! and marked `…`), so a site costs a bounded copy whatever the recording's strings.
//!
//! Python paths are normalised ([`normalised_path`]): what follows `site-packages/` or
//! `dist-packages/`, a home directory as `~`, a Python's own library from `python3.N/`.

use std::borrow::Cow;

use crate::recording::Recording;
use crate::recording::frames::{FrameId, StackId};

/// A frame's file as it reads the same across machines, users and environments.
pub fn normalised_path(path: &str) -> Cow<'_, str> {
    for marker in ["/site-packages/", "/dist-packages/"] {
        if let Some(i) = path.rfind(marker) {
            return Cow::Borrowed(&path[i + marker.len()..]);
        }
    }
    if let Some(i) = path.find("/lib/python3.") {
        return Cow::Borrowed(&path[i + "/lib/".len()..]);
    }
    for home in ["/home/", "/Users/"] {
        if let Some(rest) = path.strip_prefix(home)
            && let Some((_user, within)) = rest.split_once('/')
        {
            return Cow::Owned(format!("~/{within}"));
        }
    }
    if let Some(within) = path.strip_prefix("/root/") {
        return Cow::Owned(format!("~/{within}"));
    }
    Cow::Borrowed(path)
}

/// A site in parts: the normalised file of a Python frame and what follows it
/// (`:125 in forward`), or, for a site without a Python frame, no file and its name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Site {
    /// The normalised Python file (empty where the site has none).
    pub file: String,
    /// The rest: the line and function after the file, else the whole name.
    pub rest: String,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.file, self.rest)
    }
}

/// The site of `stack` in `recording` (see the module's documentation), as text.
pub fn site_of(recording: &Recording, stack: StackId) -> String {
    site(recording, stack).to_string()
}

/// The site of `stack` in `recording`, in parts.
pub fn site(recording: &Recording, stack: StackId) -> Site {
    let f = &recording.frames;
    let frames = f.frames_of(stack);
    let file = |id: FrameId| f.str(f.get(id).filename);
    let python = |id: &&FrameId| file(**id).ends_with(".py");
    let written = |id: &&FrameId| !generated(file(**id));
    let own = frames
        .iter()
        .filter(python)
        .filter(written)
        .find(|&&id| !file(id).contains("/torch/"));
    let torch = || frames.iter().filter(python).find(written);
    if let Some(&id) = own.or_else(torch) {
        return python_site(recording, id);
    }
    let names: Vec<&str> = frames.iter().map(|&id| f.str(f.get(id).name)).collect();
    let rest = match (autograd_node(&names), operator(&names)) {
        (Some(node), Some(op)) => format!("backward: {node} (aten::{op})"),
        (Some(node), None) => format!("backward: {node}"),
        (None, Some(op)) => format!("aten::{op}"),
        // Generated code alone: its line, the last resort (it differs between compilations).
        (None, None) => match frames.iter().find(python) {
            Some(&id) => return python_site(recording, id),
            None => frames
                .first()
                .map_or_else(|| NO_STACK.to_string(), |&id| f.describe(id)),
        },
    };
    Site {
        file: String::new(),
        rest: bounded(&rest),
    }
}

/// The most bytes of a site's file or rest kept (a recording's strings are any length).
pub const MAX_SITE_PART_BYTES: usize = 512;

/// `text` within [`MAX_SITE_PART_BYTES`], cut at a character and marked `…` where it was cut.
fn bounded(text: &str) -> String {
    if text.len() <= MAX_SITE_PART_BYTES {
        return text.to_string();
    }
    let mut end = MAX_SITE_PART_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// The site of a Python frame: its path normalised, then its line and function as people
/// read them (a compiled graph's node too).
fn python_site(recording: &Recording, id: FrameId) -> Site {
    let f = &recording.frames;
    let described = f.describe(id);
    let path = f.str(f.get(id).filename);
    match described.strip_prefix(path) {
        Some(rest) => Site {
            file: bounded(&normalised_path(path)),
            rest: bounded(rest),
        },
        None => Site {
            file: String::new(),
            rest: bounded(&described),
        },
    }
}

/// Frames listed of a site's example stack.
pub const EXAMPLE_FRAMES: usize = 8;

/// The first [`EXAMPLE_FRAMES`] frames of `stack`, innermost first, as `file:line in
/// function`: the example stack a site is shown with.
pub fn example_frames(recording: &Recording, stack: StackId) -> Vec<String> {
    let f = &recording.frames;
    f.frames_of(stack)
        .iter()
        .take(EXAMPLE_FRAMES)
        .map(|&id| f.describe(id))
        .collect()
}

/// The site of an allocation whose stack the recording did not keep.
pub const NO_STACK: &str = "(no stack recorded)";

/// Whether `path` is code `torch.compile` generated: a file under Inductor's cache
/// (`/tmp/torchinductor_<user>/…`), or one named as Inductor names its output wherever the
/// cache is (`…/p6/cp6jhjzn….py`: `c` and a long lowercase hash, in a directory named by the
/// hash's first two characters).
fn generated(path: &str) -> bool {
    if path.contains("/torchinductor_") {
        return true;
    }
    let mut parts = path.rsplit('/');
    let (Some(name), Some(dir)) = (parts.next(), parts.next()) else {
        return false;
    };
    let hash = name.strip_suffix(".py").unwrap_or_default();
    dir.len() == 2
        && hash.len() >= 40
        && hash.starts_with('c')
        && hash.get(1..3) == Some(dir)
        && hash
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The innermost autograd node of C++ frame names (`torch::autograd::generated::
/// MeanBackward0::apply(…)` → `MeanBackward0`).
fn autograd_node<'a>(names: &[&'a str]) -> Option<&'a str> {
    names.iter().find_map(|name| {
        let rest = name.split_once("torch::autograd::generated::")?.1;
        let (node, after) = rest.split_once("::")?;
        after.starts_with("apply(").then_some(node)
    })
}

/// The innermost operator of C++ frame names (`at::_ops::div_Scalar::call(…)` →
/// `div_Scalar`).
fn operator<'a>(names: &[&'a str]) -> Option<&'a str> {
    names.iter().find_map(|name| {
        let rest = name.split_once("at::_ops::")?.1;
        let op = rest.split_once("::")?.0;
        (!op.is_empty()).then_some(op)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_read_the_same_across_environments_and_users() {
        for (path, wanted) in [
            (
                "/scratch/u/uv-envs/a2/lib/python3.13/site-packages/torch/nn/modules/linear.py",
                "torch/nn/modules/linear.py",
            ),
            (
                "/opt/conda/envs/x/lib/python3.11/site-packages/transformers/models/llama.py",
                "transformers/models/llama.py",
            ),
            (
                "/usr/lib/python3/dist-packages/numpy/core.py",
                "numpy/core.py",
            ),
            (
                "/usr/lib/python3.11/contextlib.py",
                "python3.11/contextlib.py",
            ),
            (
                "/home/c-kaitwang/assignment1/cs336_basics/model.py",
                "~/assignment1/cs336_basics/model.py",
            ),
            ("/Users/ana/work/train.py", "~/work/train.py"),
            ("/root/train.py", "~/train.py"),
            ("/workspace/train.py", "/workspace/train.py"),
            ("train.py", "train.py"),
            ("", ""),
        ] {
            assert_eq!(normalised_path(path), wanted, "{path}");
        }
    }

    #[test]
    fn code_torch_compile_generated_is_told_apart_from_the_programs_own() {
        let hash = "cp6jhjzn335lo2yptjts5dpdcdk4hshtke2lv7btq23fgwnwn4mq";
        assert!(generated(&format!("/tmp/torchinductor_ana/p6/{hash}.py")));
        assert!(generated(&format!("/cache/inductor/p6/{hash}.py")));
        assert!(!generated(&format!("/cache/inductor/xx/{hash}.py")));
        assert!(!generated("~/assignment1/cs336_basics/model.py"));
        assert!(!generated("/workspace/ab/cab.py"));
        assert!(!generated("train.py"));
    }

    #[test]
    fn generated_code_names_a_site_only_where_nothing_else_does() {
        let hash = "cp6jhjzn335lo2yptjts5dpdcdk4hshtke2lv7btq23fgwnwn4mq";
        let generated = format!("/tmp/torchinductor_ana/p6/{hash}.py");
        let frame = |file: &str, line: u64, name: &str| serde_json::json!({"filename": file, "line": line, "name": name});
        let torch = frame(
            "/env/lib/python3.11/site-packages/torch/autograd/function.py",
            575,
            "apply",
        );
        let op = frame(
            "",
            0,
            "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)",
        );
        let long = format!("/{}/x.py", "d".repeat(4 * MAX_SITE_PART_BYTES));
        let stacks = [
            // A compiled backward: its generated frame, beneath torch's.
            vec![frame(&generated, 900, "call"), torch.clone()],
            // Generated code and a C++ operator only.
            vec![op.clone(), frame(&generated, 901, "call")],
            // Generated code alone.
            vec![frame(&generated, 902, "call")],
            vec![frame(&long, 1, "f")],
        ];
        let events: Vec<_> = stacks
            .iter()
            .enumerate()
            .map(|(i, frames)| {
                serde_json::json!({"action": "alloc", "addr": (i + 1) * 512, "size": 512, "stream": 0, "frames": frames})
            })
            .collect();
        let doc = serde_json::json!({"segments": [], "device_traces": [events]});
        let recording =
            crate::recording::parse_recording(doc.to_string().as_bytes()).expect("reads");
        let sites: Vec<Site> = recording.event_stacks[0]
            .iter()
            .map(|&stack| site(&recording, stack))
            .collect();
        assert_eq!(
            sites[0].to_string(),
            "torch/autograd/function.py:575 in apply"
        );
        assert_eq!(sites[1].to_string(), "aten::mm");
        assert_eq!(sites[2].file, generated);
        assert!(sites[3].file.len() <= MAX_SITE_PART_BYTES + '…'.len_utf8());
        assert!(sites[3].file.ends_with('…'), "{}", sites[3].file);
    }

    #[test]
    fn a_stack_of_cpp_frames_is_named_by_its_autograd_node_and_operator() {
        let names = [
            "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(void**)",
            "at::_ops::div_Scalar::redispatch(c10::DispatchKeySet, at::Tensor const&)",
            "at::_ops::div_Scalar::call(at::Tensor const&, c10::Scalar const&)",
            "torch::autograd::generated::MeanBackward0::apply(std::vector<at::Tensor>&&)",
            "torch::autograd::Node::operator()(std::vector<at::Tensor>&&)",
            "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask> const&)",
        ];
        assert_eq!(autograd_node(&names), Some("MeanBackward0"));
        assert_eq!(operator(&names), Some("div_Scalar"));
        assert_eq!(autograd_node(&names[..3]), None);
        assert_eq!(operator(&names[3..]), None);
    }
}
