//! A storage node refuses malformed and hostile fragments with a clear error
//! of the right kind, and keeps serving afterwards.

use std::path::PathBuf;

use crate::common;
use std::sync::Arc;

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Criteria, Ticket};
use datafusion::common::DFSchema;
use datafusion::logical_expr::{col, lit};
use datafusion::prelude::SessionContext;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::physical_plan::DefaultPhysicalExtensionCodec;
use futures::StreamExt;
use prost::Message;
use sieve_cli::cluster::{generated_tpch, EmbeddedCluster};
use sieve_compute::{AuthenticatedFlightClient, BearerAuth};
use sieve_format::SliceLayout;
use sieve_fragment::{schema_fingerprint, Fragment, FragmentBody, FragmentEnvelope, IpcCodec};
use tonic::Code;

fn test_data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tpch-sf0.01-one-node-v{}",
        sieve_format::FORMAT_VERSION
    ));
    let layout = SliceLayout {
        slice_rows_max: 20_000,
        ..SliceLayout::default()
    };
    generated_tpch(&root, 0.01, 1, 1, &layout).expect("generate TPC-H")
}

/// How region (one slice) is stored on the node.
fn region() -> common::Stored {
    common::stored(&test_data(), "region")
}

/// A valid body: ship the first column of `schema`, no filter.
fn first_column(schema: &arrow::datatypes::Schema) -> Vec<u8> {
    Fragment {
        projection: vec![0],
        predicate: None,
        aggregate: None,
    }
    .encode_body(schema)
    .unwrap()
}

struct Fixture {
    _cluster: EmbeddedCluster,
    client: AuthenticatedFlightClient,
    schema: arrow::datatypes::SchemaRef,
}

async fn fixture() -> Fixture {
    fixture_with(sieve_storage::ExecuteOptions::default()).await
}

async fn fixture_with(options: sieve_storage::ExecuteOptions) -> Fixture {
    let cluster = EmbeddedCluster::start_with(&test_data(), 1, options)
        .await
        .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(cluster.urls()[0].clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = FlightServiceClient::with_interceptor(
        channel,
        BearerAuth::new(Some(cluster.secret())).unwrap(),
    );
    let schema = Arc::clone(
        &cluster.nodes[0]
            .executor()
            .catalog()
            .table(&region().name)
            .unwrap()
            .schema,
    );
    Fixture {
        _cluster: cluster,
        client,
        schema,
    }
}

/// Send `ticket` and return the status the node answers with (first error
/// of the call or of the stream), or None if the whole stream succeeded.
async fn status_of(
    client: &mut AuthenticatedFlightClient,
    ticket: Vec<u8>,
) -> Option<tonic::Status> {
    match client.do_get(Ticket::new(ticket)).await {
        Err(status) => Some(status),
        Ok(response) => {
            let mut stream = response.into_inner();
            while let Some(message) = stream.next().await {
                if let Err(status) = message {
                    return Some(status);
                }
            }
            None
        }
    }
}

/// A valid request for region's slice 1: all columns, no predicate.
fn valid_ticket(schema: &arrow::datatypes::Schema) -> Vec<u8> {
    let body = Fragment {
        projection: (0..schema.fields().len()).collect(),
        predicate: None,
        aggregate: None,
    }
    .encode_body(schema)
    .unwrap();
    FragmentEnvelope::new(&region().name, region().slice(0), body).encode_to_vec()
}

/// Send `ticket` and check the node refuses it with `code` and a message
/// containing `text`.
async fn assert_refused(fixture: &mut Fixture, ticket: Vec<u8>, code: Code, text: &str) {
    let status = status_of(&mut fixture.client, ticket)
        .await
        .expect("refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(status.message().contains(text), "{status:?}");
}

async fn assert_still_serving(fixture: &mut Fixture) {
    let listed = fixture
        .client
        .list_flights(Criteria::default())
        .await
        .expect("catalog still served");
    assert!(listed.into_inner().next().await.is_some());
    assert!(
        status_of(&mut fixture.client, valid_ticket(&fixture.schema))
            .await
            .is_none(),
        "valid request still served"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_fragment_is_refused() {
    let mut fixture = fixture().await;
    assert_refused(
        &mut fixture,
        vec![0xff, 0x13, 0x37, 0x00, 0x42],
        Code::InvalidArgument,
        "malformed NDP fragment",
    )
    .await;

    let mut envelope = FragmentEnvelope::new(&region().name, region().slice(0), vec![1, 2, 3]);
    envelope.version = 99;
    assert_refused(
        &mut fixture,
        envelope.encode_to_vec(),
        Code::InvalidArgument,
        "version 99 is not supported",
    )
    .await;

    assert_refused(
        &mut fixture,
        FragmentEnvelope::new(&region().name, region().slice(0), vec![0xff; 7]).encode_to_vec(),
        Code::InvalidArgument,
        "malformed NDP fragment body",
    )
    .await;
    assert_still_serving(&mut fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragment_with_a_disallowed_function_is_refused() {
    let mut fixture = fixture().await;
    let context = SessionContext::new();
    let df_schema = DFSchema::try_from(Arc::clone(&fixture.schema)).unwrap();
    let random = datafusion::functions::math::expr_fn::random();
    let predicate = context
        .state()
        .create_physical_expr(
            random.lt(lit(0.5)).and(col("r_regionkey").gt(lit(0i64))),
            &df_schema,
        )
        .unwrap();
    // The compute side refuses to encode it...
    let refused = Fragment {
        projection: vec![0],
        aggregate: None,
        predicate: Some(Arc::clone(&predicate)),
    }
    .encode_body(&fixture.schema);
    assert!(refused
        .unwrap_err()
        .to_string()
        .contains("function random() is not allowed"));
    // ...and a hand-built one is refused by the storage node.
    let body = FragmentBody {
        schema_fingerprint: schema_fingerprint(&fixture.schema),
        projection: vec![0],
        aggregate: None,
        predicate: Some(
            serialize_physical_expr(&predicate, &DefaultPhysicalExtensionCodec {}).unwrap(),
        ),
    };
    let ticket = FragmentEnvelope::new(&region().name, region().slice(0), body.encode_to_vec())
        .encode_to_vec();
    assert_refused(
        &mut fixture,
        ticket,
        Code::InvalidArgument,
        "function random() is not allowed",
    )
    .await;
    assert_still_serving(&mut fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_table_is_refused() {
    let mut fixture = fixture().await;
    let body = first_column(&fixture.schema);
    assert_refused(
        &mut fixture,
        FragmentEnvelope::new("../../etc/passwd", 1, body).encode_to_vec(),
        Code::NotFound,
        "table '../../etc/passwd' is not held by this storage node",
    )
    .await;
    assert_still_serving(&mut fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slice_outside_the_catalog_is_refused() {
    let mut fixture = fixture().await;
    let body = first_column(&fixture.schema);
    assert_refused(
        &mut fixture,
        FragmentEnvelope::new(&region().name, 4242, body).encode_to_vec(),
        Code::NotFound,
        &format!("slice 4242 of table '{}' is not held", region().name),
    )
    .await;

    // A fragment planned against another schema is refused too.
    let other = arrow::datatypes::Schema::new(vec![arrow::datatypes::Field::new(
        "x",
        arrow::datatypes::DataType::Int64,
        false,
    )]);
    let body = first_column(&other);
    assert_refused(
        &mut fixture,
        FragmentEnvelope::new(&region().name, region().slice(0), body).encode_to_vec(),
        Code::InvalidArgument,
        "another schema",
    )
    .await;
    assert_still_serving(&mut fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_group_outside_the_slice_is_refused() {
    let mut fixture = fixture().await;
    let body = first_column(&fixture.schema);
    let ticket = FragmentEnvelope::new(&region().name, region().slice(0), body)
        .with_row_groups(vec![0, 4_000_000_000])
        .encode_to_vec();
    assert_refused(
        &mut fixture,
        ticket,
        Code::InvalidArgument,
        &format!(
            "row group 4000000000 of slice {} of {} does not exist",
            region().slice(0),
            region().name
        ),
    )
    .await;
    assert_still_serving(&mut fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ipc_codec_is_refused_and_each_known_one_is_served() {
    let mut fixture = fixture().await;
    let body = first_column(&fixture.schema);
    let mut envelope = FragmentEnvelope::new(&region().name, region().slice(0), body);
    envelope.ipc_codec = 77;
    assert_refused(
        &mut fixture,
        envelope.encode_to_vec(),
        Code::InvalidArgument,
        "unknown IPC codec 77",
    )
    .await;
    for codec in [
        IpcCodec::Auto,
        IpcCodec::None,
        IpcCodec::Lz4,
        IpcCodec::Zstd,
    ] {
        let ticket = FragmentEnvelope::new(
            &region().name,
            region().slice(0),
            first_column(&fixture.schema),
        )
        .with_ipc_codec(codec)
        .encode_to_vec();
        assert!(
            status_of(&mut fixture.client, ticket).await.is_none(),
            "{codec:?} served"
        );
    }
    assert_still_serving(&mut fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serving_raw_refuses_the_same_requests() {
    // Without pushdown workers every slice is served raw: a bad request
    // must still be refused, not shipped as pages.
    let mut fixture = fixture_with(sieve_storage::ExecuteOptions {
        pushdown_workers: 0,
        ..sieve_storage::ExecuteOptions::default()
    })
    .await;
    assert_refused(
        &mut fixture,
        FragmentEnvelope::new(&region().name, region().slice(0), vec![0xff; 7]).encode_to_vec(),
        Code::InvalidArgument,
        "malformed NDP fragment body",
    )
    .await;
    let body = first_column(&fixture.schema);
    let ticket = FragmentEnvelope::new(&region().name, region().slice(0), body)
        .with_row_groups(vec![0, 4_000_000_000])
        .encode_to_vec();
    assert_refused(
        &mut fixture,
        ticket,
        Code::InvalidArgument,
        &format!(
            "row group 4000000000 of slice {} of {} does not exist",
            region().slice(0),
            region().name
        ),
    )
    .await;
    let ticket =
        FragmentEnvelope::new(&region().name, 4243, first_column(&fixture.schema)).encode_to_vec();
    assert_refused(&mut fixture, ticket, Code::NotFound, "slice 4243").await;
    assert_still_serving(&mut fixture).await;
}

/// One raw HTTP/1.1 exchange with the byte-range endpoint: the status line
/// and headers (lower-cased names), the body dropped.
async fn http(
    address: std::net::SocketAddr,
    secret: &sieve_fragment::Secret,
    request_line: &str,
    extra: &str,
) -> (String, Vec<(String, String)>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "{request_line}\r\nHost: {address}\r\nAuthorization: {}\r\n{extra}Connection: close\r\n\r\n",
        secret.bearer()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default().to_string();
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    (status, headers)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

#[tokio::test]
async fn byte_range_endpoint_names_the_file_version_and_refuses_what_it_does_not_hold() {
    let fixture = fixture().await;
    let node = &fixture._cluster.nodes[0];
    let address = node.range_address();
    let secret = fixture._cluster.secret();
    let catalog = node.executor().catalog();
    let region = region();
    let (_, slice) = catalog.slice(&region.name, region.slice(0)).unwrap();
    let path = format!("/slices/{}/{}", region.name, slice.summary.file);

    // HTTP readers that cache (DuckDB's httpfs) validate with ETag and
    // Last-Modified; both are present, and stable from one request to the
    // next, for HEAD, a whole GET and a range.
    let (status, head) = http(address, secret, &format!("HEAD {path} HTTP/1.1"), "").await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let etag = header(&head, "etag").expect("ETag").to_string();
    assert!(
        etag.starts_with('"') && etag.ends_with('"') && etag.len() > 2,
        "{etag}"
    );
    let modified = header(&head, "last-modified").expect("Last-Modified");
    let parsed = httpdate::parse_http_date(modified).expect("an HTTP date");
    let age = std::time::SystemTime::now()
        .duration_since(parsed)
        .unwrap_or_default();
    assert!(
        age < std::time::Duration::from_secs(365 * 24 * 3600),
        "{modified}"
    );
    assert_eq!(
        header(&head, "content-length"),
        Some(slice.summary.bytes.to_string().as_str())
    );
    let (status, whole) = http(address, secret, &format!("GET {path} HTTP/1.1"), "").await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(header(&whole, "etag"), Some(etag.as_str()));
    let (status, ranged) = http(
        address,
        secret,
        &format!("GET {path} HTTP/1.1"),
        "Range: bytes=-8\r\n",
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 206"), "{status}");
    assert_eq!(header(&ranged, "etag"), Some(etag.as_str()));
    assert_eq!(
        header(&ranged, "content-range"),
        Some(
            format!(
                "bytes {}-{}/{}",
                slice.summary.bytes - 8,
                slice.summary.bytes - 1,
                slice.summary.bytes
            )
            .as_str()
        )
    );

    // What the catalog does not name is not served, however it is spelled.
    for hostile in [
        format!("/slices/{}/..%2F..%2F_SUCCESS", region.name),
        format!("/slices/{}/../../_SUCCESS", region.name),
        "/slices/nosuch/x.parquet".to_string(),
        format!("/slices/{}/x.parquet", region.name),
    ] {
        let (status, _) = http(address, secret, &format!("GET {hostile} HTTP/1.1"), "").await;
        assert!(status.starts_with("HTTP/1.1 404"), "{hostile}: {status}");
    }
    let (status, _) = http(
        address,
        secret,
        &format!("GET {path} HTTP/1.1"),
        &format!("Range: bytes={}-\r\n", slice.summary.bytes + 10),
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 416"), "{status}");
}

/// Slice puts (the write path of tables users own) that are wrong or
/// hostile: each refused with a clear status, nothing left on disk, the
/// node serving on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_slice_puts_are_refused_and_leave_nothing() {
    use arrow_flight::{FlightData, FlightDescriptor};
    let mut fixture = fixture().await;
    let root = test_data().join(sieve_format::node_directory(std::path::Path::new(""), 0));
    let put = |header: Vec<u8>, bodies: Vec<Vec<u8>>| {
        let mut messages = Vec::new();
        for (index, body) in bodies.into_iter().enumerate() {
            let mut message = FlightData::new().with_data_body(body);
            if index == 0 {
                message = message.with_descriptor(FlightDescriptor::new_cmd(header.clone()));
            }
            messages.push(message);
        }
        futures::stream::iter(messages)
    };
    let header = |table: &str, bytes: u64, crc32: u32| {
        serde_json::to_vec(&sieve_format::writes::PutSlice {
            table: table.to_string(),
            slice: 7,
            bytes,
            crc32,
        })
        .unwrap()
    };
    let not_parquet = b"this is not a parquet file at all".to_vec();
    let crc = crc32fast::hash(&not_parquet);
    // What, the header, the messages' bodies, the status expected.
    type Case<'a> = (&'a str, Vec<u8>, Vec<Vec<u8>>, Code);
    let cases: Vec<Case> = vec![
        (
            "no header",
            vec![],
            vec![not_parquet.clone()],
            Code::InvalidArgument,
        ),
        (
            "bad JSON",
            b"{oops".to_vec(),
            vec![vec![1]],
            Code::InvalidArgument,
        ),
        (
            "a generated table",
            header("region", 33, crc),
            vec![not_parquet.clone()],
            Code::InvalidArgument,
        ),
        (
            "a path in the name",
            header("../x@1", 33, crc),
            vec![not_parquet.clone()],
            Code::InvalidArgument,
        ),
        (
            "over the size limit",
            header("t@1", sieve_format::writes::PUT_SLICE_BYTES_MAX + 1, crc),
            vec![vec![0]],
            Code::InvalidArgument,
        ),
        (
            "more bytes than announced",
            header("t@1", 3, crc),
            vec![not_parquet.clone()],
            Code::InvalidArgument,
        ),
        (
            "fewer bytes than announced",
            header("t@1", 1000, crc),
            vec![not_parquet.clone()],
            Code::InvalidArgument,
        ),
        (
            "a wrong CRC",
            header("t@1", not_parquet.len() as u64, crc ^ 1),
            vec![not_parquet.clone()],
            Code::DataLoss,
        ),
        (
            "not Parquet",
            header("t@1", not_parquet.len() as u64, crc),
            vec![not_parquet.clone()],
            Code::InvalidArgument,
        ),
    ];
    for (what, header, bodies, code) in cases {
        let status = match fixture.client.do_put(put(header, bodies)).await {
            Ok(response) => {
                let mut results = response.into_inner();
                match results.next().await {
                    Some(Err(status)) => status,
                    other => panic!("{what}: accepted ({other:?})"),
                }
            }
            Err(status) => status,
        };
        assert_eq!(status.code(), code, "{what}: {status}");
        assert!(!status.message().is_empty(), "{what}");
    }
    // Nothing of them is on disk, and the node still serves.
    if let Ok(entries) = std::fs::read_dir(root.join("t@1")) {
        let left: Vec<_> = entries.map(|entry| entry.unwrap().file_name()).collect();
        assert!(left.is_empty(), "files left: {left:?}");
    }
    let listed = fixture
        .client
        .list_flights(Criteria::default())
        .await
        .unwrap()
        .into_inner()
        .count()
        .await;
    assert!(listed > 0);
    // A deletion vector that does not decode, in an envelope: refused.
    let body = Fragment {
        projection: vec![0],
        predicate: None,
        aggregate: None,
    }
    .encode_body(&fixture.schema)
    .unwrap();
    let envelope = FragmentEnvelope::new(&region().name, region().slice(0), body)
        .with_deleted(&[1, 2, 3, 4, 5]);
    let status = match fixture
        .client
        .do_get(Ticket::new(envelope.encode_to_vec()))
        .await
    {
        Ok(response) => {
            let mut stream = response.into_inner();
            loop {
                match stream.next().await {
                    Some(Err(status)) => break status,
                    Some(Ok(_)) => continue,
                    None => panic!("a bad deletion vector was accepted"),
                }
            }
        }
        Err(status) => status,
    };
    assert!(status.message().contains("deletion vector"), "{status}");
}
