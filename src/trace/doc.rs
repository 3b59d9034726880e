//! A decoded document (from a pickle or JSON) as a flat arena of plain values, and a cursor
//! over it that reports schema errors with the path where they occurred.
//!
//! # Invariants
//! - Containers hold node ids, never nested values: dropping or walking a document never
//!   recurses, whatever its nesting (pickles can even contain cycles).
//! - The arena grows by at most one node per input opcode, or two per JSON value (an object
//!   entry's key and value), so its size is bounded by the input's.

use super::TraceError;

/// Index of a node in a [`Doc`].
pub(crate) type NodeId = u32;

/// One decoded value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer outside `i64` (kept only to say so in errors).
    BigInt,
    Float(f64),
    Str(String),
    List(Vec<NodeId>),
    Tuple(Vec<NodeId>),
    Dict(Vec<(NodeId, NodeId)>),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "a bool",
            Value::Int(_) => "an int",
            Value::BigInt => "an int wider than 64 bits",
            Value::Float(_) => "a float",
            Value::Str(_) => "a string",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Dict(_) => "a dict",
        }
    }
}

/// A decoded document.
#[derive(Debug, Default)]
pub(crate) struct Doc {
    pub nodes: Vec<Value>,
    pub root: NodeId,
}

impl Doc {
    pub fn push(&mut self, value: Value) -> NodeId {
        self.nodes.push(value);
        (self.nodes.len() - 1) as NodeId
    }

    pub fn get(&self, id: NodeId) -> &Value {
        &self.nodes[id as usize]
    }

    pub fn get_mut(&mut self, id: NodeId) -> &mut Value {
        &mut self.nodes[id as usize]
    }

    /// A cursor at the root.
    pub fn root(&self) -> Node<'_> {
        Node {
            doc: self,
            id: self.root,
            path: String::from("$"),
        }
    }

    /// Converts parsed JSON into a document.
    pub fn from_json(json: &serde_json::Value) -> Doc {
        let mut doc = Doc::default();
        doc.root = doc.add_json(json);
        doc
    }

    fn add_json(&mut self, json: &serde_json::Value) -> NodeId {
        // serde_json limits nesting to 128 levels, which bounds this recursion.
        use serde_json::Value as J;
        let value = match json {
            J::Null => Value::None,
            J::Bool(b) => Value::Bool(*b),
            J::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => Value::Int(i),
                (None, _) if n.is_u64() => Value::BigInt,
                (None, Some(f)) => Value::Float(f),
                (None, None) => Value::BigInt,
            },
            J::String(s) => Value::Str(s.clone()),
            J::Array(items) => Value::List(items.iter().map(|v| self.add_json(v)).collect()),
            J::Object(map) => Value::Dict(
                map.iter()
                    .map(|(k, v)| {
                        let key = self.push(Value::Str(k.clone()));
                        (key, self.add_json(v))
                    })
                    .collect(),
            ),
        };
        self.push(value)
    }
}

/// A position in a document, with the path that led to it.
#[derive(Clone)]
pub(crate) struct Node<'a> {
    doc: &'a Doc,
    id: NodeId,
    path: String,
}

impl<'a> Node<'a> {
    fn value(&self) -> &'a Value {
        self.doc.get(self.id)
    }

    fn error(&self, expected: &str) -> TraceError {
        TraceError::Schema {
            path: self.path.clone(),
            expected: expected.to_string(),
            found: self.value().kind().to_string(),
        }
    }

    fn child(&self, id: NodeId, segment: impl std::fmt::Display) -> Node<'a> {
        Node {
            doc: self.doc,
            id,
            path: format!("{}{segment}", self.path),
        }
    }

    /// Whether this node is a dict.
    pub fn is_dict(&self) -> bool {
        matches!(self.value(), Value::Dict(_))
    }

    /// Whether this node is None.
    pub fn is_none(&self) -> bool {
        matches!(self.value(), Value::None)
    }

    /// The value under `key`, if this is a dict that has it.
    pub fn get(&self, key: &str) -> Result<Option<Node<'a>>, TraceError> {
        let Value::Dict(entries) = self.value() else {
            return Err(self.error("a dict"));
        };
        Ok(entries
            .iter()
            .find(|(k, _)| matches!(self.doc.get(*k), Value::Str(s) if s == key))
            .map(|&(_, v)| self.child(v, format_args!(".{key}"))))
    }

    /// The value under `key`, which must be there.
    pub fn field(&self, key: &str) -> Result<Node<'a>, TraceError> {
        self.get(key)?.ok_or_else(|| TraceError::Schema {
            path: self.path.clone(),
            expected: format!("a `{key}` key"),
            found: "none".to_string(),
        })
    }

    /// The elements of a list or tuple.
    pub fn items(&self) -> Result<impl Iterator<Item = Node<'a>> + 'a, TraceError> {
        let (Value::List(items) | Value::Tuple(items)) = self.value() else {
            return Err(self.error("a list"));
        };
        let this = self.clone();
        Ok(items
            .iter()
            .enumerate()
            .map(move |(i, &id)| this.child(id, format_args!("[{i}]"))))
    }

    /// An integer.
    pub fn int(&self) -> Result<i64, TraceError> {
        match self.value() {
            Value::Int(i) => Ok(*i),
            Value::Bool(b) => Ok(i64::from(*b)),
            _ => Err(self.error("an int")),
        }
    }

    /// A non-negative integer.
    pub fn uint(&self) -> Result<u64, TraceError> {
        u64::try_from(self.int()?).map_err(|_| self.error("a non-negative int"))
    }

    /// A number.
    pub fn float(&self) -> Result<f64, TraceError> {
        match self.value() {
            Value::Float(f) => Ok(*f),
            Value::Int(i) => Ok(*i as f64),
            _ => Err(self.error("a number")),
        }
    }

    /// A bool.
    pub fn bool(&self) -> Result<bool, TraceError> {
        match self.value() {
            Value::Bool(b) => Ok(*b),
            Value::Int(i) => Ok(*i != 0),
            _ => Err(self.error("a bool")),
        }
    }

    /// A string.
    pub fn str(&self) -> Result<&'a str, TraceError> {
        match self.value() {
            Value::Str(s) => Ok(s),
            _ => Err(self.error("a string")),
        }
    }

    /// The path of this node, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }
}
