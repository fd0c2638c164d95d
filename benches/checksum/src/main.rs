//! Times CRC32, XXH3-64 and BLAKE3 over BYTES of random data (default 400 MB, a 16K-token state
//! of the default model with H2O), and writing the same bytes to a file in DIR with and without
//! `fsync`: what each checksum adds to a save. Medians of 5, printed as a table.

use std::io::Write;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(400_000_000);
    let dir = args.get(1).map_or_else(std::env::temp_dir, Into::into);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let reps = 5;
    let mut sink = 0u64;
    let crc = time(reps, || sink ^= u64::from(crc32fast::hash(&data)));
    let xxh = time(reps, || sink ^= xxhash_rust::xxh3::xxh3_64(&data));
    let b3 = time(reps, || sink ^= blake3::hash(&data).as_bytes()[0] as u64);
    let path = dir.join(format!("checksum-bench-{}.bin", std::process::id()));
    let write = |sync: bool| {
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&data).unwrap();
        if sync {
            f.sync_all().unwrap();
        }
    };
    let plain = time(reps, || write(false));
    let synced = time(reps, || write(true));
    std::fs::remove_file(&path)?;
    let gbs = |s: f64| n as f64 / s / 1e9;
    println!("{n} bytes, medians of {reps} (checksums xor {sink:x})");
    println!("| step | seconds | GB/s | of a write with fsync |");
    println!("|---|---:|---:|---:|");
    for (name, s) in [
        ("CRC32 (crc32fast)", crc),
        ("XXH3-64 (xxhash-rust)", xxh),
        ("BLAKE3 (blake3)", b3),
        ("write", plain),
        ("write + fsync", synced),
    ] {
        println!("| {name} | {s:.3} | {:.1} | {:.1} % |", gbs(s), 100.0 * s / synced);
    }
    Ok(())
}
