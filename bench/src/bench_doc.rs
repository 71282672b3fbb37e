//! docs/BENCH.md's sections that runs of their own write (`make soak`'s, `make bench-scale`'s):
//! their markers, and replacing one section while `make bench` rewrites the rest.

pub const SOAK_BEGIN: &str = "<!-- soak -->";
pub const SOAK_END: &str = "<!-- /soak -->";
pub const SCALE_BEGIN: &str = "<!-- scale -->";
pub const SCALE_END: &str = "<!-- /scale -->";

/// Where the first line of `doc` at or after `from` that is `marker` alone begins. A marker
/// quoted in running text (bench/NOTES.md, copied into the report, names them) is not one.
fn marker_line(doc: &str, marker: &str, from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(i) = doc.get(at..)?.find(marker) {
        let start = at + i;
        let end = start + marker.len();
        let line_starts = start == 0 || doc[..start].ends_with('\n');
        let line_ends = end == doc.len() || doc[end..].starts_with('\n');
        if line_starts && line_ends {
            return Some(start);
        }
        at = end;
    }
    None
}

/// The section of `doc` from the line `begin` to the line `end`, markers included.
pub fn section_between<'a>(doc: &'a str, begin: &str, end: &str) -> Option<&'a str> {
    let a = marker_line(doc, begin, 0)?;
    let b = marker_line(doc, end, a)?;
    Some(&doc[a..b + end.len()])
}

/// `doc` with its section from the line `begin` to the line `end` replaced by `section` (or
/// appended when it has none).
pub fn splice_between(doc: &str, section: &str, begin: &str, end: &str) -> String {
    let found = marker_line(doc, begin, 0).and_then(|a| marker_line(doc, end, a).map(|b| (a, b)));
    match found {
        Some((a, b)) => {
            let rest = doc[b + end.len()..].trim_start_matches('\n');
            format!("{}{section}{rest}", &doc[..a])
        }
        None => format!("{}\n\n{section}", doc.trim_end()),
    }
}

/// `make bench`'s new docs/BENCH.md (`fresh`) with the sections of the runs of their own that
/// `previous` holds (the soak's, bench-scale's): they stay.
pub fn keep_sections(previous: &str, fresh: String) -> String {
    [(SOAK_BEGIN, SOAK_END), (SCALE_BEGIN, SCALE_END)]
        .into_iter()
        .fold(fresh, |doc, (begin, end)| {
            match section_between(previous, begin, end) {
                Some(section) => splice_between(&doc, section, begin, end),
                None => doc,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_replaces_or_appends_the_section() {
        let section = format!("{SOAK_BEGIN}\nnew\n{SOAK_END}\n");
        let doc = format!("# Benchmark\n\ntext\n\n{SOAK_BEGIN}\nold\n{SOAK_END}\n\n## After\n");
        assert_eq!(
            splice_between(&doc, &section, SOAK_BEGIN, SOAK_END),
            format!("# Benchmark\n\ntext\n\n{section}## After\n")
        );
        assert_eq!(
            splice_between("# Benchmark\n\ntext\n", &section, SOAK_BEGIN, SOAK_END),
            format!("# Benchmark\n\ntext\n\n{section}")
        );
    }

    #[test]
    fn a_marker_quoted_in_running_text_is_not_the_section() {
        let section = format!("{SCALE_BEGIN}\nnew\n{SCALE_END}\n");
        let doc = format!(
            "notes: the section between `{SCALE_BEGIN}` and `{SCALE_END}` markers\n\n{SCALE_BEGIN}\nold\n{SCALE_END}\n"
        );
        let spliced = splice_between(&doc, &section, SCALE_BEGIN, SCALE_END);
        assert!(
            spliced.starts_with("notes: the section between `<!-- scale -->`"),
            "{spliced}"
        );
        assert!(
            spliced.ends_with(&section) && !spliced.contains("old"),
            "{spliced}"
        );
        assert_eq!(
            section_between(&doc, SCALE_BEGIN, SCALE_END),
            Some(format!("{SCALE_BEGIN}\nold\n{SCALE_END}").as_str())
        );
    }

    #[test]
    fn the_benchs_report_keeps_the_soak_and_scale_sections() {
        let soak = format!("{SOAK_BEGIN}\nsoaked\n{SOAK_END}\n");
        let scale = format!("{}\ncurves\n{}\n", SCALE_BEGIN, SCALE_END);
        let previous = format!("# Benchmark\n\nold\n\n{soak}\n{scale}");
        let kept = keep_sections(&previous, "# Benchmark\n\nnew\n".into());
        assert!(kept.starts_with("# Benchmark\n\nnew\n"), "{kept}");
        assert!(kept.contains("soaked") && kept.contains("curves"), "{kept}");
        assert!(!kept.contains("old"), "{kept}");
        assert_eq!(keep_sections("nothing kept", "fresh".into()), "fresh");
    }
}
