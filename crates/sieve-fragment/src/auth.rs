//! The shared secret storage nodes and compute nodes authenticate with.
//!
//! Every request to a storage node, on Flight and on the byte-range
//! endpoint alike, carries `authorization: Bearer <secret>`; the node
//! compares it with its own copy in constant time and refuses anything
//! else. The secret itself is never printed: [`Secret`]'s `Debug` shows
//! only its length.
//!
//! ```
//! use sieve_fragment::Secret;
//! let secret = Secret::new("correct-horse-battery-staple").unwrap();
//! assert!(secret.matches_header(b"Bearer correct-horse-battery-staple"));
//! assert!(!secret.matches_header(b"Bearer correct-horse-battery-stapler"));
//! assert!(!secret.matches_header(b"correct-horse-battery-staple"));
//! assert!(!format!("{secret:?}").contains("horse"));
//! assert!(Secret::new("short").is_err());
//! ```

use datafusion::common::{plan_err, Result};

/// The header (HTTP) and metadata key (Flight) that carries the credential.
pub const AUTHORIZATION_HEADER: &str = "authorization";

/// Shortest secret accepted, in bytes: 16 random bytes hex-encoded are 32,
/// a pass phrase of a few words is longer.
pub const SECRET_BYTES_MIN: usize = 16;

/// Longest secret accepted, in bytes; it travels in a header of every request.
pub const SECRET_BYTES_MAX: usize = 1024;

/// A shared secret: visible ASCII without spaces, so that it fits in an
/// HTTP header as is, between [`SECRET_BYTES_MIN`] and [`SECRET_BYTES_MAX`]
/// bytes long.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    text: String,
}

impl Secret {
    /// `text` as a secret, with surrounding whitespace (a file's trailing
    /// newline) removed; an error if it is too short, too long or holds
    /// characters a header cannot carry.
    pub fn new(text: impl AsRef<str>) -> Result<Self> {
        let text = text.as_ref().trim();
        if text.len() < SECRET_BYTES_MIN {
            return plan_err!(
                "the storage secret is {} bytes long, below the minimum of {SECRET_BYTES_MIN}",
                text.len()
            );
        }
        if text.len() > SECRET_BYTES_MAX {
            return plan_err!(
                "the storage secret is {} bytes long, above the maximum of {SECRET_BYTES_MAX}",
                text.len()
            );
        }
        if !text.bytes().all(|byte| byte.is_ascii_graphic()) {
            return plan_err!(
                "the storage secret may hold only visible ASCII characters, without spaces"
            );
        }
        Ok(Self {
            text: text.to_string(),
        })
    }

    /// A secret made of `random` bytes, hex-encoded (the caller supplies
    /// the randomness: this crate does no I/O).
    pub fn from_random_bytes(random: &[u8]) -> Result<Self> {
        let text: String = random.iter().map(|byte| format!("{byte:02x}")).collect();
        Self::new(text)
    }

    /// The secret itself, for handing it to a child process (by
    /// environment, never on a command line).
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// The value of the authorization header: `Bearer <secret>`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.text)
    }

    /// Whether `header` is `Bearer <this secret>`. Takes the same time for
    /// every header of the right length, whatever its content, so that
    /// timing tells an attacker nothing about how much of a guess was right.
    pub fn matches_header(&self, header: &[u8]) -> bool {
        let Some(given) = header.strip_prefix(b"Bearer ") else {
            return false;
        };
        let expected = self.text.as_bytes();
        if given.len() != expected.len() {
            return false;
        }
        let difference = given
            .iter()
            .zip(expected)
            .fold(0u8, |difference, (left, right)| difference | (left ^ right));
        std::hint::black_box(difference) == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "Secret({} bytes, redacted)", self.text.len())
    }
}
