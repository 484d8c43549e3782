//! A record batch stream that keeps a value alive until it is dropped.

use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::StreamExt;

/// `stream`, holding `guard` until the stream is dropped: what `guard`'s
/// `Drop` does happens once the consumer is done with the stream, however
/// it ends (drained, failed, or dropped unpolled).
pub(crate) fn holding<G: Send + 'static>(
    stream: SendableRecordBatchStream,
    guard: G,
) -> SendableRecordBatchStream {
    let schema = stream.schema();
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        stream.map(move |batch| {
            let _ = &guard;
            batch
        }),
    ))
}
