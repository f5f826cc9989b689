#!/usr/bin/env python3
"""Plot bench/kv_quality_curve.sh's TSV as an SVG: mean KLD (log scale)
against the cache's memory as a fraction of f16, one line per dynamic series,
one labelled point per static type, dashed lines for reference values.

usage: kv_quality_svg.py IN.tsv OUT.svg TITLE [LABEL=VALUE ...]"""
import csv
import math
import sys

W, H = 760, 480
LEFT, RIGHT, TOP, BOTTOM = 80, 200, 50, 60
COLORS = ['#1f77b4', '#2ca02c', '#9467bd', '#8c564b']
STATIC_COLOR = '#d62728'
REF_COLOR = '#7f7f7f'


def read_rows(path):
    rows = list(csv.DictReader(open(path), delimiter='\t'))
    for r in rows:
        r['fraction'] = float(r['fraction'])
        r['kld_mean'] = max(float(r['kld_mean']), 1e-9)
    return rows


def scales(rows, refs):
    ys = [r['kld_mean'] for r in rows] + [v for _, v in refs]
    y_lo = 10 ** math.floor(math.log10(min(ys)))
    y_hi = 10 ** math.ceil(math.log10(max(ys)))
    x_lo, x_hi = 0.15, 1.05

    def x(f):
        return LEFT + (f - x_lo) / (x_hi - x_lo) * (W - LEFT - RIGHT)

    def y(k):
        return TOP + (math.log10(y_hi) - math.log10(k)) / (math.log10(y_hi) - math.log10(y_lo)) * (H - TOP - BOTTOM)

    return x, y, (x_lo, x_hi), (y_lo, y_hi)


def axes(out, x, y, xr, yr):
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" '
               'fill="none" stroke="#333"/>')
    f = 0.2
    while f <= xr[1] + 1e-9:
        px = x(f)
        out.append(f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{H - BOTTOM}" stroke="#eee"/>')
        out.append(f'<text x="{px:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{f * 100:.0f}%</text>')
        f += 0.1
    e = round(math.log10(yr[0]))
    while 10 ** e <= yr[1] * 1.0001:
        py = y(10 ** e)
        out.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 8}" y="{py + 4:.1f}" text-anchor="end">1e{e}</text>')
        e += 1
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 15}" text-anchor="middle">'
               'KV memory, fraction of the f16 bytes of one chunk</text>')
    out.append(f'<text x="20" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 20 {(TOP + H - BOTTOM) / 2})">mean KLD vs f32 cache (log)</text>')


def series(out, rows, x, y):
    names = [n for n in dict.fromkeys(r['series'] for r in rows) if n != 'static']
    for i, name in enumerate(names):
        pts = sorted((r['fraction'], r['kld_mean']) for r in rows if r['series'] == name)
        color = COLORS[i % len(COLORS)]
        path = ' '.join(f'{x(f):.1f},{y(k):.1f}' for f, k in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.extend(f'<circle cx="{x(f):.1f}" cy="{y(k):.1f}" r="3" fill="{color}"/>' for f, k in pts)
        ly = TOP + 20 + 20 * i
        out.append(f'<line x1="{W - RIGHT + 15}" y1="{ly}" x2="{W - RIGHT + 35}" y2="{ly}" stroke="{color}" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT + 40}" y="{ly + 4}">{name}</text>')
    for r in rows:
        if r['series'] == 'static':
            px, py = x(r['fraction']), y(r['kld_mean'])
            out.append(f'<rect x="{px - 4:.1f}" y="{py - 4:.1f}" width="8" height="8" fill="{STATIC_COLOR}"/>')
            out.append(f'<text x="{px + 7:.1f}" y="{py - 6:.1f}" fill="{STATIC_COLOR}">{r["k"]}/{r["v"]}</text>')
    ly = TOP + 20 + 20 * len(names)
    out.append(f'<rect x="{W - RIGHT + 21}" y="{ly - 4}" width="8" height="8" fill="{STATIC_COLOR}"/>')
    out.append(f'<text x="{W - RIGHT + 40}" y="{ly + 4}">static K/V types</text>')


def references(out, refs, x, y, xr):
    for label, value in refs:
        py = y(value)
        out.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}" stroke="{REF_COLOR}" '
                   'stroke-dasharray="5,4"/>')
        out.append(f'<text x="{W - RIGHT - 4}" y="{py - 4:.1f}" text-anchor="end" fill="{REF_COLOR}">{label}</text>')


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    rows = read_rows(sys.argv[1])
    refs = [(a.split('=', 1)[0], float(a.split('=', 1)[1])) for a in sys.argv[4:]]
    x, y, xr, yr = scales(rows, refs)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="25" text-anchor="middle" font-size="14">{sys.argv[3]}</text>']
    axes(out, x, y, xr, yr)
    references(out, refs, x, y, xr)
    series(out, rows, x, y)
    out.append('</svg>')
    open(sys.argv[2], 'w').write('\n'.join(out) + '\n')


if __name__ == '__main__':
    main()
