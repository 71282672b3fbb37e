//! The reports' tables: Markdown for the docs, aligned text for the terminal.

/// A table of `head` and `rows`. The first `left` columns (names) are aligned left, the rest
/// (figures) right, in Markdown and in text alike; a short row leaves its last cells empty.
pub(crate) fn table(head: &[&str], rows: &[Vec<String>], md: bool, left: usize) -> String {
    if md {
        let mut out = format!("| {} |\n|", head.join(" | "));
        for i in 0..head.len() {
            out += if i < left { "---|" } else { "---:|" };
        }
        out += "\n";
        for r in rows {
            out += &format!("| {} |\n", r.join(" | "));
        }
        return out;
    }
    let width: Vec<usize> = (0..head.len())
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in std::iter::once(head.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>())
        .chain(rows.iter().cloned())
    {
        let cells: Vec<String> = r
            .iter()
            .zip(&width)
            .enumerate()
            .map(|(i, (c, w))| {
                if i < left {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        out += cells.join("  ").trim_end();
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::table;

    #[test]
    fn names_go_left_and_figures_right() {
        let rows = vec![
            vec!["a".to_owned(), "1".to_owned()],
            vec!["bbb".to_owned(), "22".to_owned()],
        ];
        assert_eq!(
            table(&["name", "n"], &rows, true, 1),
            "| name | n |\n|---|---:|\n| a | 1 |\n| bbb | 22 |\n"
        );
        assert_eq!(
            table(&["name", "n"], &rows, false, 1),
            "name   n\na      1\nbbb   22\n"
        );
    }
}
