// PNG encoding (signature, IHDR/IDAT/IEND chunks with CRC-32; IDAT = zlib stream of STORED deflate
// blocks with Adler-32) and the drawing primitives declared in png.h. Test: tests/cpu/test_png.cpp.
#include "io/png.h"

#include "io/atomic_file.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "moekit/error.h"

namespace moekit::io {

namespace {

std::array<uint32_t, 256> make_crc_table() {
    std::array<uint32_t, 256> table{};
    for (uint32_t n = 0; n < 256; ++n) {
        uint32_t c = n;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;  // reflected 0x04c11db7
        table[n] = c;
    }
    return table;
}

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(uint8_t(v >> shift));
}

void put_chunk(std::vector<uint8_t>& out, const char type[4], const std::vector<uint8_t>& data) {
    put_be32(out, uint32_t(data.size()));
    const size_t type_at = out.size();
    out.insert(out.end(), type, type + 4);
    out.insert(out.end(), data.begin(), data.end());
    put_be32(out, crc32(out.data() + type_at, 4 + data.size()));  // CRC covers type and data
}

}  // namespace

uint32_t crc32(const uint8_t* data, size_t size_bytes, uint32_t crc) {
    static const std::array<uint32_t, 256> table = make_crc_table();
    uint32_t c = crc ^ 0xffffffffu;
    for (size_t i = 0; i < size_bytes; ++i) c = table[(c ^ data[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

uint32_t adler32(const uint8_t* data, size_t size_bytes, uint32_t adler) {
    constexpr uint32_t kMod = 65521;
    uint32_t a = adler & 0xffff, b = adler >> 16;
    for (size_t i = 0; i < size_bytes; ++i) {
        a = (a + data[i]) % kMod;
        b = (b + a) % kMod;
    }
    return (b << 16) | a;
}

std::vector<uint8_t> zlib_store(const std::vector<uint8_t>& raw) {
    constexpr size_t kMaxBlock = 65535;
    std::vector<uint8_t> out = {0x78, 0x01};  // CM=8 (deflate), 32K window; FCHECK makes 0x7801 % 31 == 0
    size_t pos = 0;
    do {
        const size_t len = std::min(kMaxBlock, raw.size() - pos);
        const bool last = pos + len == raw.size();
        out.push_back(last ? 1 : 0);  // BFINAL, BTYPE=00; the rest of the byte pads to the boundary
        out.push_back(uint8_t(len & 0xff));
        out.push_back(uint8_t(len >> 8));
        out.push_back(uint8_t(~len & 0xff));
        out.push_back(uint8_t((~len >> 8) & 0xff));
        out.insert(out.end(), raw.begin() + long(pos), raw.begin() + long(pos + len));
        pos += len;
    } while (pos < raw.size());
    put_be32(out, adler32(raw.data(), raw.size()));
    return out;
}

Image::Image(int width_, int height_, Rgb fill) : width(width_), height(height_) {
    MOEKIT_CHECK(width_ > 0 && height_ > 0, "image size ", width_, "x", height_, " must be positive");
    pixels.resize(size_t(width_) * size_t(height_) * 3);
    for (size_t i = 0; i < pixels.size(); i += 3) {
        pixels[i] = fill.r;
        pixels[i + 1] = fill.g;
        pixels[i + 2] = fill.b;
    }
}

void Image::set(int x, int y, Rgb c) {
    if (!inside(x, y)) return;
    uint8_t* p = &pixels[(size_t(y) * size_t(width) + size_t(x)) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
}

Rgb Image::get(int x, int y) const {
    MOEKIT_CHECK(inside(x, y), "pixel (", x, ", ", y, ") outside ", width, "x", height);
    const uint8_t* p = &pixels[(size_t(y) * size_t(width) + size_t(x)) * 3];
    return {p[0], p[1], p[2]};
}

std::vector<uint8_t> encode_png(const Image& image) {
    MOEKIT_CHECK(image.width > 0 && image.height > 0 &&
                     image.pixels.size() == size_t(image.width) * size_t(image.height) * 3,
                 "image ", image.width, "x", image.height, " holds ", image.pixels.size(), " bytes");
    std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};
    std::vector<uint8_t> ihdr;
    put_be32(ihdr, uint32_t(image.width));
    put_be32(ihdr, uint32_t(image.height));
    ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // bit depth 8, colour type 2 (RGB), deflate, filter 0, no interlace
    put_chunk(out, "IHDR", ihdr);

    const size_t row_bytes = size_t(image.width) * 3;
    std::vector<uint8_t> raw;
    raw.reserve((row_bytes + 1) * size_t(image.height));
    for (int y = 0; y < image.height; ++y) {
        raw.push_back(0);  // filter type None
        const auto row = image.pixels.begin() + long(size_t(y) * row_bytes);
        raw.insert(raw.end(), row, row + long(row_bytes));
    }
    put_chunk(out, "IDAT", zlib_store(raw));
    put_chunk(out, "IEND", {});
    return out;
}

void write_png(const std::string& path, const Image& image) {
    const std::vector<uint8_t> bytes = encode_png(image);
    write_file_atomically(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

// ---------------------------------------------------------------------------------------------
// Drawing.

void fill_rect(Image& image, int x0, int y0, int x1, int y1, Rgb c) {
    if (x0 > x1) std::swap(x0, x1);
    if (y0 > y1) std::swap(y0, y1);
    x0 = std::max(x0, 0), y0 = std::max(y0, 0);
    x1 = std::min(x1, image.width - 1), y1 = std::min(y1, image.height - 1);
    for (int y = y0; y <= y1; ++y)
        for (int x = x0; x <= x1; ++x) image.set(x, y, c);
}

namespace {
// Bresenham; `plot` is called for every pixel of the segment, with its index along it.
template <typename Plot>
void walk_line(int x0, int y0, int x1, int y1, Plot plot) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (int i = 0;; ++i) {
        plot(x0, y0, i);
        if (x0 == x1 && y0 == y1) break;
        const int e2 = 2 * err;
        if (e2 >= dy) err += dy, x0 += sx;
        if (e2 <= dx) err += dx, y0 += sy;
    }
}
}  // namespace

void draw_line(Image& image, int x0, int y0, int x1, int y1, Rgb c, int thickness) {
    const int lo = -(thickness - 1) / 2, hi = thickness / 2;
    walk_line(x0, y0, x1, y1, [&](int x, int y, int) { fill_rect(image, x + lo, y + lo, x + hi, y + hi, c); });
}

void draw_dashed_line(Image& image, int x0, int y0, int x1, int y1, Rgb c, int dash_px) {
    walk_line(x0, y0, x1, y1, [&](int x, int y, int i) {
        if ((i / dash_px) % 2 == 0) image.set(x, y, c);
    });
}

namespace {
struct Glyph {
    char ch;
    uint8_t rows[kGlyphHeight];  // bit 4 = leftmost column
};
constexpr Glyph kFont[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}}, {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}}, {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}}, {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}}, {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}}, {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'A', {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}}, {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
    {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}}, {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
    {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}}, {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
    {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}}, {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
    {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}}, {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
    {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}}, {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}},
    {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}}, {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
    {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}},
    {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}}, {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}},
    {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}}, {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
    {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}}, {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
    {'Y', {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}}, {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}},
    {' ', {0, 0, 0, 0, 0, 0, 0}},                      {'.', {0, 0, 0, 0, 0, 0x0C, 0x0C}},
    {',', {0, 0, 0, 0, 0x0C, 0x04, 0x08}},             {':', {0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0}},
    {'-', {0, 0, 0, 0x1F, 0, 0, 0}},                   {'+', {0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0}},
    {'/', {0, 0x01, 0x02, 0x04, 0x08, 0x10, 0}},       {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}}, {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
    {'=', {0, 0, 0x1F, 0, 0x1F, 0, 0}},                {'_', {0, 0, 0, 0, 0, 0, 0x1F}},
    {'[', {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E}}, {']', {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E}},
    {'<', {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02}}, {'>', {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08}},
    {'*', {0, 0x04, 0x15, 0x0E, 0x15, 0x04, 0}},       {'\'', {0x04, 0x04, 0x08, 0, 0, 0, 0}},
    {'?', {0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04}},
};

const Glyph& glyph_for(char ch) {
    if (ch >= 'a' && ch <= 'z') ch = char(ch - 'a' + 'A');
    for (const Glyph& g : kFont)
        if (g.ch == ch) return g;
    return kFont[sizeof(kFont) / sizeof(kFont[0]) - 1];  // '?'
}

// Draws text along a direction: (dx, dy) per glyph column step, (ux, uy) per glyph row step.
void draw_text_oriented(Image& image, int x, int y, const std::string& text, Rgb c, int scale, bool vertical) {
    for (size_t i = 0; i < text.size(); ++i) {
        const Glyph& g = glyph_for(text[i]);
        const int cell = int(i) * (kGlyphWidth + 1) * scale;
        for (int row = 0; row < kGlyphHeight; ++row)
            for (int col = 0; col < kGlyphWidth; ++col) {
                if (!(g.rows[row] & (0x10 >> col))) continue;
                const int gx = cell + col * scale, gy = row * scale;
                if (!vertical)
                    fill_rect(image, x + gx, y + gy, x + gx + scale - 1, y + gy + scale - 1, c);
                else  // rotated 90 degrees counter-clockwise: text runs upwards from (x, y)
                    fill_rect(image, x + gy, y - gx, x + gy + scale - 1, y - gx - scale + 1, c);
            }
    }
}
}  // namespace

int text_width(const std::string& text, int scale) {
    return text.empty() ? 0 : int(text.size()) * (kGlyphWidth + 1) * scale - scale;
}

void draw_text(Image& image, int x, int y, const std::string& text, Rgb c, int scale) {
    draw_text_oriented(image, x, y, text, c, scale, false);
}

void draw_text_vertical(Image& image, int x, int y, const std::string& text, Rgb c, int scale) {
    draw_text_oriented(image, x, y, text, c, scale, true);
}

// ---------------------------------------------------------------------------------------------
// Plots.

int PlotArea::px(double x) const {
    const double t = xmax > xmin ? (x - xmin) / (xmax - xmin) : 0.5;
    return x0 + int(std::lround(t * (x1 - x0)));
}

int PlotArea::py(double y) const {
    const double t = ymax > ymin ? (y - ymin) / (ymax - ymin) : 0.5;
    return y1 - int(std::lround(t * (y1 - y0)));
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
    if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi)) return {lo};
    const double raw = (hi - lo) / std::max(target, 1);
    const double mag = std::pow(10.0, std::floor(std::log10(raw)));
    double step = mag;
    for (double m : {1.0, 2.0, 5.0, 10.0})
        if (m * mag >= raw) {
            step = m * mag;
            break;
        }
    std::vector<double> ticks;
    for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step)
        ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
    return ticks;
}

std::string format_tick(double value) {
    char buf[32];
    const double a = std::abs(value);
    if (a == 0) return "0";
    if (a >= 1e4) std::snprintf(buf, sizeof buf, "%.3gk", value / 1e3);
    else if (a >= 1e-2) std::snprintf(buf, sizeof buf, "%.4g", value);
    else std::snprintf(buf, sizeof buf, "%.0e", value);
    return buf;
}

void draw_axes(Image& image, const PlotArea& area, const std::string& title, const std::string& xlabel,
               const std::string& ylabel) {
    const Rgb black{0, 0, 0}, grid{225, 225, 225}, text{40, 40, 40};
    for (double t : nice_ticks(area.xmin, area.xmax)) {
        const int x = area.px(t);
        draw_line(image, x, area.y0, x, area.y1, grid);
        draw_line(image, x, area.y1, x, area.y1 + 4, black);
        const std::string s = format_tick(t);
        draw_text(image, x - text_width(s) / 2, area.y1 + 8, s, text);
    }
    for (double t : nice_ticks(area.ymin, area.ymax)) {
        const int y = area.py(t);
        draw_line(image, area.x0, y, area.x1, y, grid);
        draw_line(image, area.x0 - 4, y, area.x0, y, black);
        const std::string s = format_tick(t);
        draw_text(image, area.x0 - 8 - text_width(s), y - kGlyphHeight / 2, s, text);
    }
    draw_line(image, area.x0, area.y0, area.x1, area.y0, black);
    draw_line(image, area.x0, area.y1, area.x1, area.y1, black);
    draw_line(image, area.x0, area.y0, area.x0, area.y1, black);
    draw_line(image, area.x1, area.y0, area.x1, area.y1, black);
    draw_text(image, (area.x0 + area.x1 - text_width(title, 2)) / 2, area.y0 - 24, title, black, 2);
    draw_text(image, (area.x0 + area.x1 - text_width(xlabel)) / 2, area.y1 + 22, xlabel, text);
    draw_text_vertical(image, area.x0 - 48, (area.y0 + area.y1 + text_width(ylabel)) / 2, ylabel, text);
}

void draw_polyline(Image& image, const PlotArea& area, const std::vector<double>& xs, const std::vector<double>& ys,
                   Rgb c, int thickness) {
    const size_t n = std::min(xs.size(), ys.size());
    auto clamp_x = [&](int x) { return std::clamp(x, area.x0, area.x1); };
    auto clamp_y = [&](int y) { return std::clamp(y, area.y0, area.y1); };
    bool have_prev = false;
    int px = 0, py = 0;
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(xs[i]) || !std::isfinite(ys[i])) {
            have_prev = false;
            continue;
        }
        const int x = clamp_x(area.px(xs[i])), y = clamp_y(area.py(ys[i]));
        if (have_prev) draw_line(image, px, py, x, y, c, thickness);
        else if (n == 1) draw_line(image, x, y, x, y, c, thickness);
        px = x, py = y, have_prev = true;
    }
}

Rgb colormap(double t) {
    // Piecewise-linear through five viridis anchor colours.
    constexpr double kAnchors[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
    t = std::isfinite(t) ? std::clamp(t, 0.0, 1.0) : 0.0;
    const double s = t * 4;
    const int i = std::min(int(s), 3);
    const double f = s - i;
    auto mix = [&](int ch) { return uint8_t(std::lround(kAnchors[i][ch] * (1 - f) + kAnchors[i + 1][ch] * f)); };
    return {mix(0), mix(1), mix(2)};
}

void draw_heatmap(Image& image, int x0, int y0, int x1, int y1, const std::vector<std::vector<double>>& values,
                  double vmin, double vmax) {
    const int rows = int(values.size());
    if (rows == 0) return;
    const double span = vmax > vmin ? vmax - vmin : 1.0;
    for (int r = 0; r < rows; ++r) {
        const int cols = int(values[size_t(r)].size());
        const int ya = y0 + (y1 - y0 + 1) * r / rows, yb = y0 + (y1 - y0 + 1) * (r + 1) / rows - 1;
        for (int c = 0; c < cols; ++c) {
            const int xa = x0 + (x1 - x0 + 1) * c / cols, xb = x0 + (x1 - x0 + 1) * (c + 1) / cols - 1;
            if (xb < xa) continue;  // more columns than pixels: neighbours share a pixel column
            fill_rect(image, xa, ya, xb, yb, colormap((values[size_t(r)][size_t(c)] - vmin) / span));
        }
    }
}

}  // namespace moekit::io
