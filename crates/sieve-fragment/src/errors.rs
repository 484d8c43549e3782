//! Errors across the wire: which failures belong to the query's data, and
//! which to the node that ran it.
//!
//! A fragment that fails on the data (a string that does not cast, a
//! division by zero, an overflow) would fail the same way on every replica
//! of the slice: failing over would only repeat the work, mark healthy nodes
//! failed and hide the user's error behind "every replica failed". Such an
//! error crosses the wire with its kind, as metadata
//! ([`ERROR_KIND_METADATA`]) next to its message, and the compute node
//! rebuilds the same DataFusion error plain DataFusion would have raised
//! ([`DataError::rebuild`]). Everything else a node reports while executing
//! (I/O, a corrupt file, a panic) is the node's, and another replica may do
//! better.
//!
//! ```
//! use datafusion::arrow::error::ArrowError;
//! use datafusion::common::DataFusionError;
//! use sieve_fragment::{classify_error, DataError, ErrorKind};
//!
//! let cast = DataFusionError::ArrowError(
//!     Box::new(ArrowError::CastError("Cannot cast string 'x' to value of Int32 type".into())),
//!     None,
//! );
//! let (kind, message) = classify_error(&cast);
//! assert_eq!(kind, ErrorKind::Data(DataError::Cast));
//! // Rebuilt on the other side of the wire, it reads as it did here.
//! let rebuilt = DataError::from_name(DataError::Cast.name()).unwrap().rebuild(message);
//! assert_eq!(rebuilt.to_string(), cast.to_string());
//!
//! let io = DataFusionError::IoError(std::io::Error::other("disk gone"));
//! assert_eq!(classify_error(&io).0, ErrorKind::Node);
//! ```

use arrow::error::ArrowError;
use datafusion::common::DataFusionError;

/// gRPC metadata key naming a [`DataError`] on a failed slice request.
pub const ERROR_KIND_METADATA: &str = "sieve-error-kind";

/// The [`ERROR_KIND_METADATA`] value of a `DataLoss` status: the node's copy
/// of the slice failed its page checksums. Another replica may hold a good
/// copy, and the node itself is fine: the compute node fails over without
/// marking the node failed.
pub const CORRUPT_SLICE_KIND: &str = "corrupt-slice";

/// gRPC metadata key naming the damaged slice file on a `DataLoss` status.
pub const CORRUPT_FILE_METADATA: &str = "sieve-corrupt-file";

/// Whose fault a failure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request cannot be served as asked, by any node.
    Plan,
    /// The query's data: every replica would fail the same way.
    Data(DataError),
    /// A limit of the node was reached.
    Resources,
    /// The node's own failure: another replica may succeed.
    Node,
}

/// A failure of the query on its data, by the DataFusion / Arrow error it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataError {
    /// `ArrowError::CastError`.
    Cast,
    /// `ArrowError::DivideByZero`.
    DivideByZero,
    /// `ArrowError::ArithmeticOverflow`.
    Overflow,
    /// `ArrowError::ComputeError`.
    Compute,
    /// `ArrowError::InvalidArgumentError`.
    InvalidArgument,
    /// `ArrowError::ParseError`.
    Parse,
    /// `DataFusionError::Execution`.
    Execution,
}

const DATA_ERRORS: [DataError; 7] = [
    DataError::Cast,
    DataError::DivideByZero,
    DataError::Overflow,
    DataError::Compute,
    DataError::InvalidArgument,
    DataError::Parse,
    DataError::Execution,
];

impl DataError {
    /// The name sent as [`ERROR_KIND_METADATA`].
    pub fn name(self) -> &'static str {
        match self {
            Self::Cast => "cast",
            Self::DivideByZero => "divide-by-zero",
            Self::Overflow => "overflow",
            Self::Compute => "compute",
            Self::InvalidArgument => "invalid-argument",
            Self::Parse => "parse",
            Self::Execution => "execution",
        }
    }

    /// The kind named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        DATA_ERRORS.into_iter().find(|kind| kind.name() == name)
    }

    /// The DataFusion error this kind and message came from.
    pub fn rebuild(self, message: String) -> DataFusionError {
        let arrow = |error: ArrowError| DataFusionError::ArrowError(Box::new(error), None);
        match self {
            Self::Cast => arrow(ArrowError::CastError(message)),
            Self::DivideByZero => arrow(ArrowError::DivideByZero),
            Self::Overflow => arrow(ArrowError::ArithmeticOverflow(message)),
            Self::Compute => arrow(ArrowError::ComputeError(message)),
            Self::InvalidArgument => arrow(ArrowError::InvalidArgumentError(message)),
            Self::Parse => arrow(ArrowError::ParseError(message)),
            Self::Execution => DataFusionError::Execution(message),
        }
    }
}

/// Whose fault `error` is, and the message to send: for a data error the
/// innermost message only, so that [`DataError::rebuild`] gives back the
/// same error.
pub fn classify_error(error: &DataFusionError) -> (ErrorKind, String) {
    let root = error.find_root();
    let data = |kind: DataError, message: &str| (ErrorKind::Data(kind), message.to_string());
    match root {
        DataFusionError::Plan(message) => (ErrorKind::Plan, message.clone()),
        DataFusionError::ResourcesExhausted(message) => (ErrorKind::Resources, message.clone()),
        DataFusionError::Execution(message) => data(DataError::Execution, message),
        DataFusionError::ArrowError(arrow, _) => match arrow.as_ref() {
            ArrowError::CastError(message) => data(DataError::Cast, message),
            ArrowError::DivideByZero => data(DataError::DivideByZero, ""),
            ArrowError::ArithmeticOverflow(message) => data(DataError::Overflow, message),
            ArrowError::ComputeError(message) => data(DataError::Compute, message),
            ArrowError::InvalidArgumentError(message) => data(DataError::InvalidArgument, message),
            ArrowError::ParseError(message) => data(DataError::Parse, message),
            _ => (ErrorKind::Node, error.to_string()),
        },
        _ => (ErrorKind::Node, error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_data_error_survives_the_wire_as_itself() {
        for kind in DATA_ERRORS {
            let original = kind.rebuild(format!("message of {}", kind.name()));
            let (classified, message) = classify_error(&original);
            assert_eq!(classified, ErrorKind::Data(kind));
            let name = kind.name();
            let rebuilt = DataError::from_name(name).unwrap().rebuild(message);
            assert_eq!(rebuilt.to_string(), original.to_string());
        }
        // Wrapped in context, the root still decides.
        let wrapped = DataError::DivideByZero
            .rebuild(String::new())
            .context("while filtering");
        assert_eq!(
            classify_error(&wrapped).0,
            ErrorKind::Data(DataError::DivideByZero)
        );
        let io = DataFusionError::ArrowError(
            Box::new(ArrowError::IoError(
                "read".into(),
                std::io::Error::other("gone"),
            )),
            None,
        );
        assert_eq!(classify_error(&io).0, ErrorKind::Node);
        assert_eq!(DataError::from_name("disk"), None);
    }
}
