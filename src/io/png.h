// A tiny PNG writer (RGB8, 8-bit truecolour; the zlib stream holds STORED deflate blocks, so no
// compression library is needed) plus the few drawing primitives `moekit train` uses for its plot:
// filled rectangles, lines, a 5x7 bitmap font, plot axes, polylines and a heat map.
// Decode-checked by tests/cpu/test_png.cpp; the training figure is composed in src/train/report.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moekit::io {

// Running checksums as PNG and zlib define them; pass the previous value to continue a stream.
uint32_t crc32(const uint8_t* data, size_t size_bytes, uint32_t crc = 0);
uint32_t adler32(const uint8_t* data, size_t size_bytes, uint32_t adler = 1);

// zlib stream (RFC 1950) of STORED deflate blocks (RFC 1951 BTYPE=00, at most 65535 bytes each).
std::vector<uint8_t> zlib_store(const std::vector<uint8_t>& raw);

struct Rgb {
    uint8_t r = 0, g = 0, b = 0;
};

// An RGB8 image, row-major, top row first.
struct Image {
    int width = 0, height = 0;
    std::vector<uint8_t> pixels;  // [height, width, 3]

    Image() = default;
    Image(int width_, int height_, Rgb fill = {255, 255, 255});
    bool inside(int x, int y) const { return x >= 0 && y >= 0 && x < width && y < height; }
    void set(int x, int y, Rgb c);  // ignores points outside the image
    Rgb get(int x, int y) const;
};

std::vector<uint8_t> encode_png(const Image& image);
// Throws UsageError naming the path when it cannot be written.
void write_png(const std::string& path, const Image& image);

// ---- drawing ----
void fill_rect(Image& image, int x0, int y0, int x1, int y1, Rgb c);  // inclusive corners, any order
void draw_line(Image& image, int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
void draw_dashed_line(Image& image, int x0, int y0, int x1, int y1, Rgb c, int dash_px = 6);

constexpr int kGlyphWidth = 5, kGlyphHeight = 7;
// 5x7 font: digits, letters (lower case drawn as upper case) and . , : - + / ( ) % = _ [ ] < > * ';
// anything else draws as '?'. One character cell is (kGlyphWidth + 1) * scale wide.
int text_width(const std::string& text, int scale = 1);
void draw_text(Image& image, int x, int y, const std::string& text, Rgb c, int scale = 1);
void draw_text_vertical(Image& image, int x, int y, const std::string& text, Rgb c, int scale = 1);  // bottom-up

// Data coordinates -> pixels inside the box [x0, x1] x [y0, y1] (pixel y grows downwards).
struct PlotArea {
    int x0 = 0, y0 = 0, x1 = 0, y1 = 0;
    double xmin = 0, xmax = 1, ymin = 0, ymax = 1;
    int px(double x) const;
    int py(double y) const;
};

// "Nice" tick values (1, 2, 5 x 10^n) covering [lo, hi], about `target` of them.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);
std::string format_tick(double value);  // short: 0.5, 12, 1.2k, 3e-4

// Frame, ticks with labels, axis labels and a title above the box.
void draw_axes(Image& image, const PlotArea& area, const std::string& title, const std::string& xlabel,
               const std::string& ylabel);
// Connects the points (xs[i], ys[i]) that are finite, clipped to the area.
void draw_polyline(Image& image, const PlotArea& area, const std::vector<double>& xs, const std::vector<double>& ys,
                   Rgb c, int thickness = 1);

// Colour map from dark blue (t = 0) through teal and green to yellow (t = 1), viridis-like.
Rgb colormap(double t);
// values[row][col] drawn into the box, row 0 at the top, each cell a solid block; colour of v is
// colormap((v - vmin) / (vmax - vmin)), clamped.
void draw_heatmap(Image& image, int x0, int y0, int x1, int y1, const std::vector<std::vector<double>>& values,
                  double vmin, double vmax);

}  // namespace moekit::io
