//! PostgreSQL's text format of `COPY ... FROM STDIN` (psql's plain
//! `\copy`, psycopg's `write_row`), rewritten as CSV while it streams in,
//! so that the load reads it as `COPY ... FROM 'file' WITH (FORMAT csv)`
//! does: a line a row, fields split at the delimiter (a tab unless told),
//! the NULL marker (`\N` unless told) a NULL, backslash escapes undone
//! (`\t`, `\n`, `\\`, `\010`, `\x41`, ...), and every other value quoted,
//! so an empty field stays an empty string. A line `\.` ends the data.
//!
//! The CSV side marks a NULL as `\N` unquoted. A value that is `\N`
//! itself once unescaped (sent as `\\N`) would read as a NULL there: it is
//! refused with its line instead.

/// What a NULL is in the CSV this writes (`NULL '\N'` of the load).
pub const CSV_NULL: &str = "\\N";

/// Longest line the rewriter holds while waiting for its end.
pub const LINE_BYTES_MAX: usize = 64 << 20;

/// Rewrites text-format rows to CSV, chunk by chunk.
#[derive(Debug)]
pub struct TextToCsv {
    delimiter: u8,
    null: Vec<u8>,
    skip_header: bool,
    pending: Vec<u8>,
    line: u64,
    ended: bool,
}

impl TextToCsv {
    /// A rewriter for fields split at `delimiter`, `null` a NULL, the
    /// first line a header to skip when `header`.
    pub fn new(delimiter: u8, null: &str, header: bool) -> Self {
        Self {
            delimiter,
            null: null.as_bytes().to_vec(),
            skip_header: header,
            pending: Vec::new(),
            line: 0,
            ended: false,
        }
    }

    /// Rewrite the whole lines of `data` (with what earlier chunks left)
    /// into `out`; a part line waits for the next chunk.
    pub fn push(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        let mut start = 0;
        for (index, &byte) in data.iter().enumerate() {
            if byte == b'\n' {
                if self.pending.is_empty() {
                    self.row(&data[start..index], out)?;
                } else {
                    let mut line = std::mem::take(&mut self.pending);
                    line.extend_from_slice(&data[start..index]);
                    self.row(&line, out)?;
                }
                start = index + 1;
            }
        }
        self.pending.extend_from_slice(&data[start..]);
        if self.pending.len() > LINE_BYTES_MAX {
            return Err(format!(
                "line {} is longer than {LINE_BYTES_MAX} bytes (LINE_BYTES_MAX)",
                self.line + 1
            ));
        }
        Ok(())
    }

    /// The last line, if the data did not end with a line break.
    pub fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.row(&line, out)?;
        }
        Ok(())
    }

    fn row(&mut self, line: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.line += 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if self.ended {
            return Ok(());
        }
        if line == b"\\." {
            self.ended = true;
            return Ok(());
        }
        if self.skip_header {
            self.skip_header = false;
            return Ok(());
        }
        let mut field = Vec::new();
        let mut raw_start = 0;
        let mut first = true;
        let mut index = 0;
        while index <= line.len() {
            let at_end = index == line.len();
            if at_end || line[index] == self.delimiter {
                let raw = &line[raw_start..index];
                if !first {
                    out.push(b',');
                }
                first = false;
                if raw == self.null.as_slice() {
                    out.extend_from_slice(CSV_NULL.as_bytes());
                } else {
                    field.clear();
                    unescape(raw, &mut field);
                    if field == CSV_NULL.as_bytes() {
                        return Err(format!(
                            "line {}: a value that is \\N itself cannot be told from a NULL here",
                            self.line
                        ));
                    }
                    out.push(b'"');
                    for &byte in &field {
                        if byte == b'"' {
                            out.push(b'"');
                        }
                        out.push(byte);
                    }
                    out.push(b'"');
                }
                index += 1;
                raw_start = index;
                continue;
            }
            // An escaped byte (the delimiter too) belongs to the field.
            index += if line[index] == b'\\' { 2 } else { 1 };
        }
        out.push(b'\n');
        Ok(())
    }
}

/// `raw` with PostgreSQL's backslash escapes undone.
fn unescape(raw: &[u8], out: &mut Vec<u8>) {
    let mut index = 0;
    while index < raw.len() {
        let byte = raw[index];
        index += 1;
        if byte != b'\\' || index == raw.len() {
            out.push(byte);
            continue;
        }
        let next = raw[index];
        index += 1;
        match next {
            b'b' => out.push(8),
            b'f' => out.push(12),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(11),
            b'0'..=b'7' => {
                let mut value = u32::from(next - b'0');
                for _ in 0..2 {
                    match raw.get(index) {
                        Some(&digit @ b'0'..=b'7') => {
                            value = value * 8 + u32::from(digit - b'0');
                            index += 1;
                        }
                        _ => break,
                    }
                }
                out.push(value as u8);
            }
            b'x' if raw.get(index).is_some_and(u8::is_ascii_hexdigit) => {
                let mut value = 0u32;
                for _ in 0..2 {
                    match raw.get(index) {
                        Some(&digit) if digit.is_ascii_hexdigit() => {
                            value = value * 16 + (digit as char).to_digit(16).unwrap_or(0);
                            index += 1;
                        }
                        _ => break,
                    }
                }
                out.push(value as u8);
            }
            other => out.push(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite(chunks: &[&[u8]], header: bool) -> Result<String, String> {
        let mut rewriter = TextToCsv::new(b'\t', "\\N", header);
        let mut out = Vec::new();
        for chunk in chunks {
            rewriter.push(chunk, &mut out)?;
        }
        rewriter.finish(&mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn text_rows_become_csv_rows() {
        let text: &[u8] =
            b"1\tplain\t\\N\n2\t\t\"quoted\"\n3\ttab\\there\\\\slash\\nnewline\tx\\101\\x42\n";
        assert_eq!(
            rewrite(&[text], false).unwrap(),
            "\"1\",\"plain\",\\N\n\"2\",\"\",\"\"\"quoted\"\"\"\n\"3\",\"tab\there\\slash\nnewline\",\"xAB\"\n"
        );
    }

    #[test]
    fn lines_split_across_chunks_escaped_delimiters_and_the_end_marker() {
        let whole = rewrite(&[b"1\ta\\\tb\r\n2\tc\n\\.\nignored\n"], false).unwrap();
        let split = rewrite(
            &[b"1\ta\\", b"\tb\r", b"\n2\t", b"c\n\\", b".\nignored\n"],
            false,
        )
        .unwrap();
        assert_eq!(whole, "\"1\",\"a\tb\"\n\"2\",\"c\"\n");
        assert_eq!(split, whole);
        assert_eq!(rewrite(&[b"k\tv\n1\tx"], true).unwrap(), "\"1\",\"x\"\n");
    }

    #[test]
    fn a_value_that_reads_as_the_csv_null_is_refused() {
        let error = rewrite(&[b"1\tok\n2\t\\\\N\n"], false).unwrap_err();
        assert!(error.contains("line 2"), "{error}");
        // With another marker, \N itself is refused too; the marker is NULL.
        let mut rewriter = TextToCsv::new(b'|', "NA", false);
        let mut out = Vec::new();
        rewriter.push(b"NA|\\\\N\n", &mut out).unwrap_err();
        let mut out = Vec::new();
        TextToCsv::new(b'|', "NA", false)
            .push(b"NA|x\n", &mut out)
            .unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "\\N,\"x\"\n");
    }
}
