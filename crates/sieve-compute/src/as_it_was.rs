//! Sieve's optional plan rewrites, run so that a rewrite that fails keeps
//! the plan as it was.

use std::panic::AssertUnwindSafe;

use datafusion::common::Result;

/// What `rewrite` returns for one plan node, or `None` (the node planned
/// as it was) where it returns an error or panics: each rule is an
/// optimization, never a reason for a query to fail. A panic is a bug in
/// the rule, and the plan it was rewriting is still right (fuzzer seed
/// 20261702: `AggregateBeforeJoin` indexed past its aggregation's columns
/// for a join on one key twice, and the query failed).
pub(crate) fn or_as_it_was<T>(
    rule: &str,
    rewrite: impl FnOnce() -> Result<Option<T>>,
) -> Option<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(rewrite)) {
        Ok(Ok(rewritten)) => rewritten,
        Ok(Err(error)) => {
            log::debug!("{rule}: plan kept as it was: {error}");
            None
        }
        Err(panic) => {
            let message = panic_message(panic.as_ref());
            log::warn!("{rule}: plan kept as it was: the rule panicked: {message}");
            None
        }
    }
}

/// The text a panic was raised with (`panic!`'s message), empty for any
/// other payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|message| (*message).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use datafusion::common::DataFusionError;

    use super::{or_as_it_was, panic_message};

    #[test]
    fn an_error_or_a_panic_keeps_the_plan() {
        assert_eq!(or_as_it_was("rule", || Ok(Some(1))), Some(1));
        assert_eq!(or_as_it_was::<i32>("rule", || Ok(None)), None);
        assert_eq!(
            or_as_it_was::<i32>("rule", || Err(DataFusionError::Plan("no".into()))),
            None
        );
        assert_eq!(
            or_as_it_was::<i32>("rule", || panic!("a bug in the rule")),
            None
        );
    }

    #[test]
    fn a_panics_message_is_its_text() {
        assert_eq!(panic_message(&"static text"), "static text");
        assert_eq!(panic_message(&format!("formatted {}", 7)), "formatted 7");
        assert_eq!(panic_message(&7_u8), "");
    }
}
