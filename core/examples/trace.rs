//! Traces the seed's agent-fork and tree scenarios through the bookkeeping, printing each
//! step's plan: which cells it writes, the read window, and the mask.

use kvplug_core::{CacheResult, PosRange, SeqBookkeeping, StepPlan, TreeBookkeeping};

fn show(label: &str, p: &StepPlan) {
    let cells: Vec<usize> = (0..p.n_tok).map(|i| p.cell_of(i)).collect();
    println!(
        "{label}: {} tokens at positions {:?} -> cells {cells:?}, window [0, {}), {}",
        p.n_tok,
        p.positions,
        p.read_len,
        p.kind().as_str()
    );
    if p.kind() == kvplug_core::PlanKind::Explicit {
        for i in 0..p.n_tok {
            let row: String = (0..p.read_len)
                .map(|j| if p.visible(i, j) { '#' } else { '.' })
                .collect();
            println!("    query {i} (pos {:>2}) {row}", p.positions[i]);
        }
    }
}

fn main() -> CacheResult<()> {
    println!("== agent fork: trunk of 4, three branches, keep branch 2 ==");
    let mut s = SeqBookkeeping::new(64);
    show("trunk", s.plan(&[0, 1, 2, 3])?);
    for br in 1..=3 {
        s.seq_cp(0, br, PosRange::ALL)?;
    }
    s.begin_step(&[1, 2, 3])?;
    show("branches", s.plan(&[4, 4, 4])?);
    s.seq_keep(2)?;
    println!(
        "seq_keep(2): live cells {}, window {}",
        s.live_cells(),
        s.high_water()
    );
    s.begin_step(&[2])?;
    show("decode", s.plan(&[5])?);

    println!("\n== tree: prefix of 3, the seed's frontier parents [-1, 0, 0, 1] ==");
    let mut t = TreeBookkeeping::new(64);
    show("prefix", t.plan(&[0, 1, 2])?);
    t.propose(&[-1, 0, 0, 1])?;
    show("verify", t.plan(&[3, 4, 4, 5])?);
    let c = t.commit(&[0, 1, 3])?;
    println!(
        "commit [0, 1, 3]: rows {:?} -> cells {}.., prefix now {}",
        c.rows,
        c.base,
        t.base()
    );
    Ok(())
}
