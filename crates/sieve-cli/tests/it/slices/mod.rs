//! One slice request straight to a storage node, for the test files that
//! talk Flight to a node themselves (`mod slices;`).

use arrow_flight::{FlightData, Ticket};
use futures::StreamExt;
use prost::Message;
use sieve_compute::AuthenticatedFlightClient;
use sieve_fragment::{SliceMessage, SliceMessageKind, SliceMetrics};

/// Send `ticket` (an encoded envelope) and read the whole answer: the
/// messages that carry the slice's data, and its metrics trailer.
pub(crate) async fn slice_messages(
    client: &mut AuthenticatedFlightClient,
    ticket: Vec<u8>,
) -> (Vec<FlightData>, SliceMetrics) {
    let mut stream = client
        .do_get(Ticket::new(ticket))
        .await
        .unwrap()
        .into_inner();
    let mut metrics = None;
    let mut messages = Vec::new();
    while let Some(message) = stream.next().await {
        let message = message.unwrap();
        if message.data_header.is_empty() && !message.app_metadata.is_empty() {
            if let Ok(SliceMessage {
                kind: Some(SliceMessageKind::Metrics(found)),
            }) = SliceMessage::decode(message.app_metadata.as_ref())
            {
                metrics = Some(found);
                continue;
            }
        }
        messages.push(message);
    }
    (messages, metrics.expect("a metrics trailer"))
}
