//! How a fragment's operators and Sieve's own expressions cross the wire.
//!
//! A pushed aggregate travels as a datafusion-proto `PhysicalPlanNode` whose
//! leaf is a [`SliceInputExec`]: a placeholder for "the slice, filtered and
//! projected by this fragment". The storage node decodes the plan once and
//! puts its slice scan in the placeholder's place for every slice.
//! [`BloomFilterExpr`] and [`KeyBitmapExpr`], the join filters' membership
//! tests, are the other extensions this codec knows.

use std::fmt;
use std::sync::Arc;

use arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, plan_datafusion_err, plan_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_expr_common::physical_expr::proto_decode::PhysicalExprDecodeCtx;
use datafusion::physical_expr_common::physical_expr::proto_encode::PhysicalExprEncodeCtx;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use prost::Message;

use crate::{BloomFilterExpr, KeyBitmapExpr};

/// Stands for the slice's rows after the fragment's filter and projection.
/// Never executed: the storage node replaces it before running the plan.
/// With statistics, it also lets a compute node ask DataFusion's operators
/// for estimates over rows it does not have.
#[derive(Debug)]
pub struct SliceInputExec {
    properties: Arc<PlanProperties>,
    statistics: Option<Statistics>,
}

impl SliceInputExec {
    /// A placeholder producing `schema`.
    pub fn new(schema: SchemaRef) -> Self {
        Self {
            properties: Arc::new(PlanProperties::new(
                EquivalenceProperties::new(schema),
                Partitioning::UnknownPartitioning(1),
                EmissionType::Incremental,
                Boundedness::Bounded,
            )),
            statistics: None,
        }
    }

    /// The placeholder, reporting `statistics` for its rows.
    pub fn with_statistics(mut self, statistics: Statistics) -> Self {
        self.statistics = Some(statistics);
        self
    }
}

impl DisplayAs for SliceInputExec {
    fn fmt_as(
        &self,
        _format: DisplayFormatType,
        formatter: &mut fmt::Formatter<'_>,
    ) -> fmt::Result {
        write!(formatter, "SliceInputExec")
    }
}

impl ExecutionPlan for SliceInputExec {
    fn name(&self) -> &str {
        "SliceInputExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !children.is_empty() {
            return internal_err!("SliceInputExec has no children");
        }
        Ok(self)
    }

    fn partition_statistics(&self, _partition: Option<usize>) -> Result<Arc<Statistics>> {
        Ok(Arc::new(match &self.statistics {
            Some(statistics) => statistics.clone(),
            None => Statistics::new_unknown(&self.schema()),
        }))
    }

    fn execute(
        &self,
        _partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        internal_err!("SliceInputExec is a placeholder and is replaced before execution")
    }
}

/// Wire form of Sieve's own expressions; the input (the key column) travels
/// as the extension node's child.
#[derive(Clone, PartialEq, Message)]
struct SieveExprNode {
    #[prost(oneof = "SieveExprKind", tags = "1, 2")]
    kind: Option<SieveExprKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum SieveExprKind {
    #[prost(message, tag = "1")]
    Bloom(BloomFilterNode),
    #[prost(message, tag = "2")]
    Bitmap(KeyBitmapNode),
}

/// Wire form of a [`KeyBitmapExpr`]: its words as they are (`words`) or,
/// from [`KEY_BITMAP_ZSTD_BYTES_MIN`] bytes, as one zstd frame
/// (`words_zstd`), which a storage node decompresses chunk by chunk into
/// the chunks it keeps: a 75 MB bitmap of SF 100's order keys never exists
/// whole on a node.
#[derive(Clone, PartialEq, Message)]
struct KeyBitmapNode {
    /// The bitmap's 64-bit words, little endian.
    #[prost(bytes = "vec", tag = "1")]
    words: Vec<u8>,
    #[prost(bytes = "vec", tag = "5")]
    words_zstd: Vec<u8>,
    #[prost(int64, tag = "2")]
    base: i64,
    #[prost(uint64, tag = "3")]
    bits: u64,
    #[prost(uint64, tag = "4")]
    keys: u64,
    /// A window ([`KeyBitmapExpr::window`]): `words` are those of whole
    /// chunks from `first_chunk` on; the values of the other chunks pass.
    #[prost(bool, tag = "6")]
    windowed: bool,
    #[prost(uint64, tag = "7")]
    first_chunk: u64,
}

/// A key bitmap of at least this many bytes travels compressed on its own
/// ([`KeyBitmapNode`]): 1 MiB.
pub const KEY_BITMAP_ZSTD_BYTES_MIN: usize = 1024 * 1024;

/// Wire form of a [`BloomFilterExpr`].
#[derive(Clone, PartialEq, Message)]
struct BloomFilterNode {
    #[prost(bytes = "vec", tag = "1")]
    bitset: Vec<u8>,
    #[prost(uint64, tag = "2")]
    keys: u64,
    #[prost(double, tag = "3")]
    fpp: f64,
}

/// Wire form of a [`SliceInputExec`]: nothing; its schema is the fragment's
/// projection of the table schema, which the decoder knows.
#[derive(Clone, PartialEq, Message)]
struct SliceInputNode {
    #[prost(uint32, tag = "1")]
    marker: u32,
}

const SLICE_INPUT_MARKER: u32 = 0x51_1c_e0;

/// The codec for fragments. `slice_schema` is the schema a decoded
/// [`SliceInputExec`] gets (the fragment's projection of the table schema).
#[derive(Clone)]
pub struct SieveCodec {
    slice_schema: Option<SchemaRef>,
    key_ranges: Option<KeyRanges>,
}

/// The value ranges (inclusive) a storage node's slices hold in a column,
/// by name and type, if every slice's statistics say: a key bitmap over
/// that column is cut to them ([`KeyBitmapExpr::from_parts_cut`]).
pub type KeyRanges = Arc<dyn Fn(&str, &DataType) -> Option<Vec<(i64, i64)>> + Send + Sync>;

impl fmt::Debug for SieveCodec {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SieveCodec")
            .field("slice_schema", &self.slice_schema)
            .field("key_ranges", &self.key_ranges.is_some())
            .finish()
    }
}

impl SieveCodec {
    /// A codec for encoding (and for decoding expressions only).
    pub fn new() -> Self {
        Self {
            slice_schema: None,
            key_ranges: None,
        }
    }

    /// A codec that decodes a [`SliceInputExec`] with `schema`.
    pub fn with_slice_schema(schema: SchemaRef) -> Self {
        Self {
            slice_schema: Some(schema),
            key_ranges: None,
        }
    }

    /// A codec that cuts each key bitmap it decodes over a column to the
    /// value ranges `key_ranges` gives for it.
    pub fn with_key_ranges(mut self, key_ranges: KeyRanges) -> Self {
        self.key_ranges = Some(key_ranges);
        self
    }
}

impl Default for SieveCodec {
    fn default() -> Self {
        Self::new()
    }
}

impl PhysicalExtensionCodec for SieveCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        _ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node = SliceInputNode::decode(buf)
            .map_err(|error| plan_datafusion_err!("malformed fragment operator: {error}"))?;
        if node.marker != SLICE_INPUT_MARKER || !inputs.is_empty() {
            return plan_err!("unknown operator in NDP fragment");
        }
        let Some(schema) = &self.slice_schema else {
            return plan_err!("a slice input is not expected in this part of the fragment");
        };
        Ok(Arc::new(SliceInputExec::new(Arc::clone(schema))))
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if node.downcast_ref::<SliceInputExec>().is_none() {
            return plan_err!("operator {} cannot be part of an NDP fragment", node.name());
        }
        SliceInputNode {
            marker: SLICE_INPUT_MARKER,
        }
        .encode(buf)
        .map_err(|error| plan_datafusion_err!("cannot encode fragment operator: {error}"))
    }

    fn try_decode_expr(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn PhysicalExpr>],
        ctx: &PhysicalExprDecodeCtx<'_>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let node = SieveExprNode::decode(buf)
            .map_err(|error| plan_datafusion_err!("malformed join filter expression: {error}"))?;
        let [input] = inputs else {
            return plan_err!(
                "a join filter expression has one input, got {}",
                inputs.len()
            );
        };
        let data_type: DataType = input.data_type(ctx.schema())?;
        match node.kind {
            Some(SieveExprKind::Bloom(bloom)) => Ok(Arc::new(BloomFilterExpr::from_bitset(
                Arc::clone(input),
                data_type,
                bloom.bitset,
                bloom.keys,
                bloom.fpp,
            )?)),
            Some(SieveExprKind::Bitmap(bitmap)) => {
                let ranges = self.key_ranges.as_ref().and_then(|key_ranges| {
                    let column = input.downcast_ref::<Column>()?;
                    key_ranges(column.name(), &data_type)
                });
                if bitmap.windowed {
                    if !bitmap.words_zstd.is_empty() {
                        return plan_err!("a key bitmap window travels uncompressed");
                    }
                    return Ok(Arc::new(KeyBitmapExpr::from_window(
                        Arc::clone(input),
                        data_type,
                        bitmap.base,
                        bitmap.bits,
                        bitmap.first_chunk,
                        &bitmap.words,
                        bitmap.keys,
                    )?));
                }
                if !bitmap.words_zstd.is_empty() {
                    if !bitmap.words.is_empty() {
                        return plan_err!("a key bitmap has its words twice");
                    }
                    return Ok(Arc::new(KeyBitmapExpr::from_zstd(
                        Arc::clone(input),
                        data_type,
                        bitmap.base,
                        bitmap.bits,
                        &bitmap.words_zstd,
                        bitmap.keys,
                        ranges.as_deref(),
                    )?));
                }
                Ok(Arc::new(KeyBitmapExpr::from_parts_cut(
                    Arc::clone(input),
                    data_type,
                    bitmap.base,
                    bitmap.bits,
                    &bitmap.words,
                    bitmap.keys,
                    ranges.as_deref(),
                )?))
            }
            None => plan_err!("unknown expression in NDP fragment"),
        }
    }

    fn try_encode_expr(
        &self,
        node: &Arc<dyn PhysicalExpr>,
        buf: &mut Vec<u8>,
        _ctx: &PhysicalExprEncodeCtx<'_>,
    ) -> Result<()> {
        let kind = if let Some(bloom) = node.downcast_ref::<BloomFilterExpr>() {
            SieveExprKind::Bloom(BloomFilterNode {
                bitset: bloom.bitset().to_vec(),
                keys: bloom.keys(),
                fpp: bloom.fpp(),
            })
        } else if let Some(bitmap) = node.downcast_ref::<KeyBitmapExpr>() {
            if let Some((first_chunk, words)) = bitmap.window_words() {
                let kind = SieveExprKind::Bitmap(KeyBitmapNode {
                    words: words.iter().flat_map(|word| word.to_le_bytes()).collect(),
                    words_zstd: Vec::new(),
                    base: bitmap.base(),
                    bits: bitmap.bits(),
                    keys: bitmap.keys(),
                    windowed: true,
                    first_chunk: first_chunk as u64,
                });
                return SieveExprNode { kind: Some(kind) }
                    .encode(buf)
                    .map_err(|error| {
                        plan_datafusion_err!("cannot encode join filter expression: {error}")
                    });
            }
            let (words, words_zstd) = if bitmap.word_bytes() >= KEY_BITMAP_ZSTD_BYTES_MIN {
                (Vec::new(), bitmap.to_zstd()?)
            } else {
                (bitmap.to_bytes(), Vec::new())
            };
            SieveExprKind::Bitmap(KeyBitmapNode {
                words,
                words_zstd,
                base: bitmap.base(),
                bits: bitmap.bits(),
                keys: bitmap.keys(),
                windowed: false,
                first_chunk: 0,
            })
        } else {
            return plan_err!("expression {node} cannot be part of an NDP fragment");
        };
        SieveExprNode { kind: Some(kind) }
            .encode(buf)
            .map_err(|error| plan_datafusion_err!("cannot encode join filter expression: {error}"))
    }
}
