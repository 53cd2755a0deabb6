// The seeded generator of the reference scripts (mulberry32): the same draws on every run and
// every machine, so a reference corpus is the same file everywhere.
export function seeded(seed) {
  let state = seed | 0;
  function rand() {
    state = (state + 0x6d2b79f5) | 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  const pick = (a) => a[Math.floor(rand() * a.length)];
  const between = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));
  return { rand, pick, between };
}
