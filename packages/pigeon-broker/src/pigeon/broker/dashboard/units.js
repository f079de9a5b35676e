// PigeonMQ dashboard: numbers, sizes and rates as a person writes them, the same rules as
// the CLI's (pigeon.client._units): counts with thousands separators, sizes in decimal SI
// units with one decimal above a kilobyte ("999 B", "1.5 kB", "16.9 MB"), byte rates the
// same with "/s" ("16.9 MB/s"), durations in whole units largest first ("1 d", "1 h 30 min").
// Loaded before dashboard.js as window.PigeonUnits; a CommonJS module under node (tests).
(function (root) {
  "use strict";
  const SIZE_UNITS = ["B", "kB", "MB", "GB", "TB", "PB"];
  const DURATION_UNITS = [["d", 86400], ["h", 3600], ["min", 60], ["s", 1]];
  const missing = (n) => n === null || n === undefined || Number.isNaN(Number(n));

  // 86400 -> "86,400"; 2.25 -> "2.3" (digits after the point, none for a whole number)
  function number(n, digits) {
    if (missing(n)) return "–";
    n = Number(n);
    const d = Number.isInteger(n) ? 0 : (digits === undefined ? 1 : digits);
    return n.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
  }
  function plural(count, noun, nouns) {
    return number(count, 0) + " " + (Number(count) === 1 ? noun : (nouns || noun + "s"));
  }
  function size(n) {
    if (missing(n)) return "–";
    n = Number(n);
    if (n < 0) return number(n);
    let i = 0;
    while (n >= 1000 && i < SIZE_UNITS.length - 1) { n /= 1000; i++; }
    return i === 0 ? Math.trunc(n) + " B" : n.toFixed(1) + " " + SIZE_UNITS[i];
  }
  function rate(n) { return missing(n) ? "–" : size(n) + "/s"; }
  function duration(seconds) {
    if (missing(seconds)) return "–";
    seconds = Number(seconds);
    if (seconds < 0) return number(seconds);
    if (seconds > 0 && seconds < 1) return number(seconds * 1000) + " ms";
    let whole = Math.trunc(seconds);
    const parts = [];
    for (const [unit, length] of DURATION_UNITS) {
      if (whole >= length) { parts.push(number(Math.floor(whole / length), 0) + " " + unit); whole %= length; }
    }
    return parts.join(" ") || "0 s";
  }
  const api = { number: number, plural: plural, size: size, rate: rate, duration: duration };
  if (typeof module === "object" && module.exports) module.exports = api;
  else root.PigeonUnits = api;
})(this);
