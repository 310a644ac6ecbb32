// Quality is measured with the library's own evaluate_selection (float64) on the selections the
// CPU selectors produce. Selectors always see the whole problem (a Q tile's representative needs
// all its queries); only the measurement is restricted to a tail of the queries, because it costs
// a float64 dense attention per (selector, budget).
//
// The oracle is computed from the same float64 dense softmax: for each budget k it keeps the k
// blocks (or k * 128 keys) with the most dense mass. Kept mass is additive over blocks and keys
// and the reported mean is a sum over queries of per-query fractions, so each oracle is exactly
// optimal for the mean kept mass among selections of its granularity:
//   oracle TileLists (per group and Q tile) >= every TileLists selector at budget k,
//   oracle QueryLists (per group and query) >= every block selector at budget k,
//   oracle TokenLists (k * 128 keys per query) >= every selector at budget k.
// The program checks these bounds on every run; a violation is a bug and exits 1.
#include "eval.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>

#include "common.hpp"
#include "core/cpu.hpp"
#include "core/safetensors.hpp"
#include "selectors/select_common.hpp"
#include "workload.hpp"

namespace sparse_attn::cli {

namespace {

const std::string kOp = "sparse-attn eval";

const std::vector<std::string> kTensorNames{"q", "k", "v", "qidx", "kidx", "qI", "w", "kI"};
const std::vector<std::string> kSelectorNames{"all",           "pooled-r1",     "pooled-r4",
                                              "token-max",     "token-max-bf16", "token-max-fp8",
                                              "token-max-fp4", "lightning",      "oracle"};

// ---- inputs --------------------------------------------------------------------------------------

struct Inputs {
  ProblemShape p;
  HostTensor q, k, v;
  // Index tensors of token_max (qidx, kidx) and lightning (qI, w, kI), when the input holds them.
  std::optional<HostTensor> qidx, kidx, qI, w, kI;
  std::vector<PlantedNeedle> needles;
  std::string source;
};

DType tensor_dtype(const detail::SafetensorsEntry& e, const std::string& path) {
  if (e.dtype == "F32") return DType::f32;
  if (e.dtype == "F16") return DType::f16;
  if (e.dtype == "BF16") return DType::bf16;
  throw Error(kOp, "--input",
              fmt::format("{}: tensor '{}' has dtype {}, expected F32, F16 or BF16", path, e.name, e.dtype));
}

HostTensor to_host(const detail::SafetensorsEntry& e, const std::string& path) {
  HostTensor t(tensor_dtype(e, path), e.shape);
  std::copy(e.data.begin(), e.data.end(), static_cast<std::byte*>(t.view().data));
  return t;
}

std::string dims_string(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// `expected` holds -1 for an extent that is free; `names` says what each extent is.
void check_entry_shape(const detail::SafetensorsEntry& e, const std::string& path,
                       const std::vector<std::int64_t>& expected, const std::string& names) {
  bool ok = e.shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < expected.size(); ++i)
    ok = e.shape[i] > 0 && (expected[i] < 0 || e.shape[i] == expected[i]);
  if (!ok)
    throw Error(kOp, "--input",
                fmt::format("{}: tensor '{}' has shape {}, expected {} = {} (-1: any extent > 0)", path, e.name,
                            dims_string(e.shape), names, dims_string(expected)));
}

std::vector<PlantedNeedle> needles_from_metadata(const std::string& text, const ProblemShape& p,
                                                 const std::string& path) {
  std::vector<PlantedNeedle> out;
  try {
    // JSON from a file: checked in one linear pass before the (recursive) values exist.
    if (const std::string fault = detail::untrusted_json_fault(text, 4); !fault.empty())
      throw std::runtime_error("the JSON text " + fault);
    for (const auto& n : nlohmann::json::parse(text)) {
      PlantedNeedle nd{n.at("b").get<std::int64_t>(),      n.at("group").get<std::int64_t>(),
                       n.at("q_tile").get<std::int64_t>(), n.at("kv_block").get<std::int64_t>(),
                       n.at("keys").at(0).get<std::int64_t>(), n.at("keys").at(1).get<std::int64_t>()};
      if (nd.b < 0 || nd.b >= p.B || nd.g < 0 || nd.g >= p.Hkv || nd.tile < 0 || nd.tile >= p.Tq() ||
          nd.key_begin < 0 || nd.key_begin >= nd.key_end || nd.key_end > p.Lk)
        throw std::runtime_error("needle " + detail::printable(n.dump()) + " lies outside the problem " + p.describe());
      out.push_back(nd);
    }
  } catch (const std::exception& e) {
    throw Error(kOp, "--input", fmt::format("{}: metadata 'sparse_attn.needles' is invalid: {}", path, e.what()));
  }
  return out;
}

Inputs load_input(const std::string& path, bool causal) {
  const detail::SafetensorsFile file = detail::read_safetensors(path, kOp + " --input");
  auto get = [&](const std::string& name) -> const detail::SafetensorsEntry& {
    if (!file.contains(name)) {
      std::string held;
      for (const auto& t : file.tensors) held += (held.empty() ? "" : ", ") + t.name;
      throw Error(kOp, "--input",
                  fmt::format("{}: missing tensor '{}' (the file holds: {})", path, name, held.empty() ? "nothing" : held));
    }
    return file.get(name);
  };
  Inputs in;
  const auto& q = get("q");
  const auto& k = get("k");
  const auto& v = get("v");
  check_entry_shape(q, path, {-1, -1, -1, -1}, "[B, Lq, Hq, D]");
  ProblemShape& p = in.p;
  p.B = q.shape[0], p.Lq = q.shape[1], p.Hq = q.shape[2], p.D = q.shape[3];
  check_entry_shape(k, path, {p.B, -1, -1, p.D}, "[B, Lk, Hkv, D]");
  p.Lk = k.shape[1], p.Hkv = k.shape[2];
  p.causal = causal;
  check_entry_shape(v, path, {p.B, p.Lk, p.Hkv, p.D}, "[B, Lk, Hkv, D]");
  if (p.Hq % p.Hkv != 0)
    throw Error(kOp, "--input",
                fmt::format("{}: q has {} heads, not a multiple of the {} KV heads of k", path, p.Hq, p.Hkv));
  if (tensor_dtype(k, path) != tensor_dtype(q, path) || tensor_dtype(v, path) != tensor_dtype(q, path))
    throw Error(kOp, "--input",
                fmt::format("{}: q, k and v must share one dtype, got {}, {} and {}", path, q.dtype, k.dtype, v.dtype));
  in.q = to_host(q, path);
  in.k = to_host(k, path);
  in.v = to_host(v, path);

  const bool has_qidx = file.contains("qidx"), has_kidx = file.contains("kidx");
  if (has_qidx != has_kidx)
    throw Error(kOp, "--input", fmt::format("{}: token_max needs both 'qidx' and 'kidx'; the file holds only '{}'",
                                            path, has_qidx ? "qidx" : "kidx"));
  if (has_qidx) {
    const auto& qi = get("qidx");
    check_entry_shape(qi, path, {p.B, p.Lq, p.Hkv, -1}, "[B, Lq, Hkv, Di]");
    const auto& ki = get("kidx");
    check_entry_shape(ki, path, {p.B, p.Lk, -1, qi.shape[3]}, "[B, Lk, 1 or Hkv, Di]");
    if (ki.shape[2] != 1 && ki.shape[2] != p.Hkv)
      throw Error(kOp, "--input", fmt::format("{}: tensor 'kidx' has {} heads, expected 1 or {}", path, ki.shape[2], p.Hkv));
    in.qidx = to_host(qi, path);
    in.kidx = to_host(ki, path);
  }
  const int lightning_parts = int(file.contains("qI")) + int(file.contains("w")) + int(file.contains("kI"));
  if (lightning_parts != 0 && lightning_parts != 3)
    throw Error(kOp, "--input", fmt::format("{}: lightning needs all of 'qI', 'w' and 'kI', or none", path));
  if (lightning_parts == 3) {
    const auto& qI = get("qI");
    check_entry_shape(qI, path, {p.B, p.Lq, -1, -1}, "[B, Lq, HI, Di]");
    const auto& w = get("w");
    check_entry_shape(w, path, {p.B, p.Lq, qI.shape[2]}, "[B, Lq, HI]");
    if (w.dtype != "F32") throw Error(kOp, "--input", fmt::format("{}: tensor 'w' has dtype {}, expected F32", path, w.dtype));
    const auto& kI = get("kI");
    check_entry_shape(kI, path, {p.B, p.Lk, qI.shape[3]}, "[B, Lk, Di]");
    in.qI = to_host(qI, path);
    in.w = to_host(w, path);
    in.kI = to_host(kI, path);
  }
  if (auto it = file.metadata.find("sparse_attn.needles"); it != file.metadata.end())
    in.needles = needles_from_metadata(it->second, p, path);
  in.source = path;
  return in;
}

/// The index tensors the CLI uses when the input has none, as the demo does: token_max scores
/// the first query head of each group against k; lightning uses every query head as an index
/// head with equal weights against the mean of the KV heads.
struct IndexViews {
  TensorView qidx, kidx, qI, w, kI;
  std::string token_max_note, lightning_note;
  HostTensor w_store, kI_store;  // owned fallbacks
};

TensorView first_head_of_each_group(const TensorView& q, const ProblemShape& p) {
  TensorView t = q;
  t.shape[2] = p.Hkv;
  t.stride[2] *= p.group_size();
  return t;
}

HostTensor equal_weights(const ProblemShape& p) {
  HostTensor w(DType::f32, {p.B, p.Lq, p.Hq});
  std::fill_n(w.data<float>(), w.numel(), 1.0f / float(p.Hq));
  return w;
}

std::unique_ptr<IndexViews> index_views(const Inputs& in) {
  auto iv = std::make_unique<IndexViews>();
  const ProblemShape& p = in.p;
  if (in.qidx) {
    iv->qidx = in.qidx->view();
    iv->kidx = in.kidx->view();
    iv->token_max_note = "qidx and kidx of the input";
  } else {
    iv->qidx = first_head_of_each_group(in.q.view(), p);
    iv->kidx = in.k.view();
    iv->token_max_note = "q and k of the first query head of each group (the input has no qidx/kidx)";
  }
  if (in.qI) {
    iv->qI = in.qI->view();
    iv->w = in.w->view();
    iv->kI = in.kI->view();
    iv->lightning_note = "qI, w and kI of the input";
  } else {
    iv->w_store = equal_weights(p);
    iv->kI_store = mean_kv_heads(in.k.view());
    iv->qI = in.q.view();
    iv->w = iv->w_store.view();
    iv->kI = iv->kI_store.view();
    iv->lightning_note =
        "every query head as an index head, equal weights, keys = mean of the KV heads (the input has no qI/w/kI)";
  }
  return iv;
}

void save_synthetic(const EvalConfig& c) {
  std::vector<std::string> names = c.save_tensors.empty() ? kTensorNames : c.save_tensors;
  for (const auto& n : names)
    if (std::find(kTensorNames.begin(), kTensorNames.end(), n) == kTensorNames.end())
      throw Error(kOp, "--save-tensors", fmt::format("unknown tensor '{}' (expected some of q, k, v, qidx, kidx, qI, w, kI)", n));
  check_writable(c.save_synthetic);
  SyntheticConfig sc{c.seed, c.batch, c.len, c.heads, c.kv_heads, c.needles, 0};
  sc.needle_first_query = tail_start(c.len, c.eval_queries < 0 ? 512 : c.eval_queries);
  progress("building the synthetic workload (B={}, Hq={}, Hkv={}, L={}, seed {})", c.batch, c.heads, c.kv_heads, c.len, c.seed);
  const SyntheticWorkload wl = make_synthetic_workload(sc);
  Inputs in;
  in.p = wl.p;
  in.q = wl.q;
  in.k = wl.k;
  in.v = wl.v;
  const auto iv = index_views(in);

  detail::SafetensorsFile file;
  auto add = [&](const std::string& name, const TensorView& t, const char* dtype) {
    if (std::find(names.begin(), names.end(), name) == names.end()) return;
    detail::SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype;
    e.shape.assign(t.shape.begin(), t.shape.begin() + t.ndim);
    // Densely packed copy: qidx is a strided view of q.
    HostTensor dense(t.dtype, e.shape);
    const std::int64_t inner = t.shape[t.ndim - 1];
    const std::int64_t rows = t.numel() / inner, esize = static_cast<std::int64_t>(dtype_size(t.dtype));
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t rem = r, off = 0;
      for (int d = t.ndim - 2; d >= 0; --d) {
        off += (rem % t.shape[d]) * t.stride[d];
        rem /= t.shape[d];
      }
      std::copy_n(static_cast<const std::byte*>(t.data) + off * esize, inner * esize,
                  static_cast<std::byte*>(dense.view().data) + r * inner * esize);
    }
    const auto* bytes = static_cast<const std::byte*>(dense.view().data);
    e.data.assign(bytes, bytes + dense.numel() * esize);
    file.tensors.push_back(std::move(e));
  };
  add("q", in.q.view(), "BF16");
  add("k", in.k.view(), "BF16");
  add("v", in.v.view(), "BF16");
  add("qidx", iv->qidx, "BF16");
  add("kidx", iv->kidx, "BF16");
  add("qI", iv->qI, "BF16");
  add("w", iv->w, "F32");
  add("kI", iv->kI, "BF16");
  nlohmann::json needles = nlohmann::json::array();
  for (const auto& nd : wl.needles)
    needles.push_back({{"b", nd.b}, {"group", nd.g}, {"q_tile", nd.tile}, {"kv_block", nd.block},
                       {"keys", {nd.key_begin, nd.key_end}}});
  file.metadata["sparse_attn.workload"] = "synthetic (sinks, local bands, planted needles)";
  file.metadata["sparse_attn.causal"] = "true";
  file.metadata["sparse_attn.seed"] = std::to_string(c.seed);
  file.metadata["sparse_attn.needles"] = needles.dump();
  detail::write_safetensors(c.save_synthetic, file);
  std::string saved;
  for (const auto& t : file.tensors) saved += (saved.empty() ? "" : ", ") + t.name;
  fmt::print("wrote {}: {} ({}, {} planted needles); evaluate it with `sparse-attn eval --input {}`\n",
             c.save_synthetic, saved, wl.p.describe(), wl.needles.size(), c.save_synthetic);
}

// ---- the oracle ----------------------------------------------------------------------------------

/// Oracle selections of one budget, over the evaluated queries only (the tail problem).
struct OracleLists {
  HostTensor tile_idx, tile_cnt, query_idx, token_idx;
};

/// One float64 dense pass over the tail queries `qt` (problem `pt`) yields the oracle lists of
/// every budget. Work is split over (batch, group, Q tile) so each job owns its tile's lists.
std::vector<OracleLists> oracle_select(const TensorView& qt, const TensorView& k, const ProblemShape& pt, double scale,
                                       const std::vector<int>& budgets) {
  const std::int64_t Tq = pt.Tq(), Tk = pt.Tk(), D = pt.D, gs = pt.group_size();
  std::vector<OracleLists> out;
  std::int64_t max_tokens = 0;
  for (int kb : budgets) {
    const std::int64_t kt = std::min<std::int64_t>(std::int64_t(kb) * kBlockK, pt.Lk);
    max_tokens = std::max(max_tokens, kt);
    OracleLists o{HostTensor(DType::i32, {pt.B, pt.Hkv, Tq, kb}), HostTensor(DType::i32, {pt.B, pt.Hkv, Tq}),
                  HostTensor(DType::i32, {pt.B, pt.Hkv, pt.Lq, kb}), HostTensor(DType::i32, {pt.B, pt.Hkv, pt.Lq, kt})};
    out.push_back(std::move(o));
  }
  // k of every (batch, group) as float rows.
  std::vector<float> kf(static_cast<std::size_t>(pt.B * pt.Hkv * pt.Lk * D));
  detail::parallel_for(pt.B * pt.Hkv, [&](std::int64_t bg) {
    for (std::int64_t j = 0; j < pt.Lk; ++j)
      detail::load_bhld(k, bg / pt.Hkv, j, bg % pt.Hkv, kf.data() + (bg * pt.Lk + j) * D);
  });

  detail::parallel_for(pt.B * pt.Hkv * Tq, [&](std::int64_t job) {
    const std::int64_t t = job % Tq, bg = job / Tq, b = bg / pt.Hkv, g = bg % pt.Hkv;
    const float* krows = kf.data() + bg * pt.Lk * D;
    std::vector<double> tile_mass(static_cast<std::size_t>(Tk), 0.0), query_mass(static_cast<std::size_t>(Tk));
    std::vector<double> token_mass(static_cast<std::size_t>(pt.Lk)), s(static_cast<std::size_t>(pt.Lk));
    std::vector<float> qf(static_cast<std::size_t>(D));
    std::vector<detail::Scored> cand;
    std::vector<std::int32_t> ids;
    constexpr std::int64_t kChunk = 32;
    const float* rows[kChunk];
    const std::int64_t i0 = t * kTileQ, i1 = std::min(pt.Lq, i0 + kTileQ);

    // Ranks the candidates once and writes the prefix of each budget, ascending.
    auto write_lists = [&](std::int64_t n_cand, auto&& width_of, auto&& row_ptr) {
      std::int64_t need = 0;
      for (std::size_t bi = 0; bi < budgets.size(); ++bi) need = std::max(need, std::min(width_of(bi), n_cand));
      std::partial_sort(cand.begin(), cand.begin() + need, cand.end(), detail::ranks_before);
      for (std::size_t bi = 0; bi < budgets.size(); ++bi) {
        const std::int64_t m = std::min(width_of(bi), n_cand);
        ids.resize(static_cast<std::size_t>(m));
        for (std::int64_t r = 0; r < m; ++r) ids[static_cast<std::size_t>(r)] = cand[static_cast<std::size_t>(r)].id;
        std::sort(ids.begin(), ids.end());
        detail::write_padded(row_ptr(bi), 1, width_of(bi), ids);
      }
    };

    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t end = pt.key_end(i);
      std::fill(token_mass.begin(), token_mass.begin() + end, 0.0);
      for (std::int64_t h = g * gs; h < (g + 1) * gs && end > 0; ++h) {
        detail::load_bhld(qt, b, i, h, qf.data());
        for (std::int64_t j0 = 0; j0 < end; j0 += kChunk) {
          const std::int64_t n = std::min(kChunk, end - j0);
          for (std::int64_t r = 0; r < n; ++r) rows[r] = krows + (j0 + r) * D;
          detail::dots_f64(qf.data(), rows, n, D, s.data() + j0);
        }
        double m = -std::numeric_limits<double>::infinity(), z = 0.0;
        for (std::int64_t j = 0; j < end; ++j) m = std::max(m, s[static_cast<std::size_t>(j)] * scale);
        for (std::int64_t j = 0; j < end; ++j) z += (s[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] * scale - m));
        for (std::int64_t j = 0; j < end; ++j) token_mass[static_cast<std::size_t>(j)] += s[static_cast<std::size_t>(j)] / z;
      }
      const std::int64_t blocks = ceil_div(end, kBlockK);
      std::fill(query_mass.begin(), query_mass.end(), 0.0);
      for (std::int64_t j = 0; j < end; ++j) query_mass[static_cast<std::size_t>(j / kBlockK)] += token_mass[static_cast<std::size_t>(j)];
      for (std::int64_t j = 0; j < blocks; ++j) tile_mass[static_cast<std::size_t>(j)] += query_mass[static_cast<std::size_t>(j)];

      cand.clear();
      for (std::int64_t j = 0; j < blocks; ++j) cand.push_back({query_mass[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)});
      write_lists(
          blocks, [&](std::size_t bi) { return std::int64_t(budgets[bi]); },
          [&](std::size_t bi) { return detail::idx_ptr4(out[bi].query_idx.view(), b, g, i, 0); });
      cand.clear();
      for (std::int64_t j = 0; j < end; ++j) cand.push_back({token_mass[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)});
      write_lists(
          end, [&](std::size_t bi) { return out[bi].token_idx.view().shape[3]; },
          [&](std::size_t bi) { return detail::idx_ptr4(out[bi].token_idx.view(), b, g, i, 0); });
    }
    // Candidates of the tile: blocks holding a key its last query sees (key_end grows with i).
    const std::int64_t tile_blocks = ceil_div(pt.key_end(i1 - 1), kBlockK);
    cand.clear();
    for (std::int64_t j = 0; j < tile_blocks; ++j) cand.push_back({tile_mass[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)});
    write_lists(
        tile_blocks, [&](std::size_t bi) { return std::int64_t(budgets[bi]); },
        [&](std::size_t bi) { return detail::idx_ptr4(out[bi].tile_idx.view(), b, g, t, 0); });
    for (std::size_t bi = 0; bi < budgets.size(); ++bi)
      *reinterpret_cast<std::int32_t*>(detail::addr4(out[bi].tile_cnt.view(), b, g, t, 0)) =
          static_cast<std::int32_t>(std::min<std::int64_t>(budgets[bi], tile_blocks));
  });
  return out;
}

// ---- selectors -----------------------------------------------------------------------------------

enum class Kind { pooled_r1, pooled_r4, token_max_queries, token_max_tiles, lightning_tokens, lightning_blocks,
                  oracle_tiles, oracle_queries, oracle_tokens };

struct Variant {
  Kind kind;
  std::string name;    // table label
  std::string format;  // TileLists, QueryLists, TokenLists
  IndexPrecision precision = IndexPrecision::bf16;
};

std::vector<Variant> variants_for(const std::vector<std::string>& selectors) {
  auto want = [&](const std::string& s) {
    return std::find(selectors.begin(), selectors.end(), s) != selectors.end() ||
           std::find(selectors.begin(), selectors.end(), "all") != selectors.end();
  };
  for (const auto& s : selectors)
    if (std::find(kSelectorNames.begin(), kSelectorNames.end(), s) == kSelectorNames.end()) {
      std::string known;
      for (const auto& n : kSelectorNames) known += (known.empty() ? "" : ", ") + n;
      throw Error(kOp, "--selector", fmt::format("unknown selector '{}' (expected one of: {})", s, known));
    }
  std::vector<Variant> v;
  if (want("pooled-r1")) v.push_back({Kind::pooled_r1, "pooled R1", "TileLists"});
  if (want("pooled-r4")) v.push_back({Kind::pooled_r4, "pooled R4", "TileLists"});
  const std::pair<IndexPrecision, const char*> precisions[] = {
      {IndexPrecision::bf16, "token-max-bf16"}, {IndexPrecision::fp8_e4m3, "token-max-fp8"}, {IndexPrecision::fp4_e2m1, "token-max-fp4"}};
  for (const auto& [prec, flag] : precisions)
    if (want("token-max") || want(flag)) {
      const std::string name = fmt::format("token_max {}", precision_name(prec));
      v.push_back({Kind::token_max_queries, name, "QueryLists", prec});
      v.push_back({Kind::token_max_tiles, name, "TileLists", prec});
    }
  if (want("lightning")) {
    v.push_back({Kind::lightning_tokens, "lightning fp8", "TokenLists", IndexPrecision::fp8_e4m3});
    v.push_back({Kind::lightning_blocks, "lightning fp8", "QueryLists", IndexPrecision::fp8_e4m3});
  }
  if (want("oracle")) {
    v.push_back({Kind::oracle_tiles, "oracle", "TileLists"});
    v.push_back({Kind::oracle_queries, "oracle", "QueryLists"});
    v.push_back({Kind::oracle_tokens, "oracle", "TokenLists"});
  }
  return v;
}

bool is_oracle(Kind k) { return k == Kind::oracle_tiles || k == Kind::oracle_queries || k == Kind::oracle_tokens; }

/// Granularity rank: a selection of rank r is bounded by the oracle of every rank >= r.
int granularity(const std::string& format) { return format == "TileLists" ? 0 : format == "QueryLists" ? 1 : 2; }

struct Row {
  const Variant* variant = nullptr;
  int budget = 0;
  std::int64_t keys_per_query = 0;  // the most keys one query may select
  double select_ms = NAN;       // NaN for the oracle (one shared dense pass)
  QualityReport quality;
  double needles = NAN;
};

std::string pct(double x) { return std::isnan(x) ? "-" : fmt::format("{:.1f}%", 100.0 * x); }

nlohmann::json number_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

}  // namespace

CLI::App* add_eval_subcommand(CLI::App& app, EvalConfig& c) {
  auto* sub = app.add_subcommand(
      "eval", "Selection quality: kept attention mass and output error of every selector against dense attention");
  auto* input = sub->add_option("--input", c.input,
                                "safetensors file with q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D] (F32/F16/BF16), optional "
                                "qidx/kidx (token_max) and qI/w/kI (lightning)");
  auto* synthetic = sub->add_flag("--synthetic", c.synthetic,
                                  "The structured synthetic workload of `demo` (sinks, local bands, planted needles)");
  auto* save = sub->add_option("--save-synthetic", c.save_synthetic,
                               "Write the synthetic workload (and its index tensors, needles in the metadata) to this "
                               "safetensors file, then exit");
  input->excludes(synthetic)->excludes(save);
  synthetic->excludes(save);
  sub->add_option("--save-tensors", c.save_tensors, "With --save-synthetic: which tensors to write (default all)")
      ->delimiter(',')->needs(save);
  sub->add_option("--selector", c.selectors,
                  "all, pooled-r1, pooled-r4, token-max, token-max-bf16, token-max-fp8, token-max-fp4, lightning, oracle "
                  "(repeatable, comma-separated)")
      ->delimiter(',')->capture_default_str();
  sub->add_option("--budget", c.budgets,
                  "KV blocks per Q tile / per query (repeatable, comma-separated); token selections keep 128x as many keys")
      ->delimiter(',')->capture_default_str()->check(CLI::Range(1, 1 << 16));
  sub->add_option("--eval-queries", c.eval_queries,
                  "Measure on the last N queries (whole Q tiles); 0: every query; default 512 for --synthetic, all for --input")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  sub->add_flag("--non-causal", c.non_causal, "--input only: every query sees every key")->needs(input);
  sub->add_option("--softmax-scale", c.softmax_scale, "Softmax scale (default 1/sqrt(D))")
      ->check(finite_range(1e-30, 1e30));
  sub->add_option("--seed", c.seed, "Synthetic: seed")->capture_default_str()->check(unsigned_integer())->excludes(input);
  sub->add_option("--len", c.len, "Synthetic: sequence length (queries = keys, causal)")
      ->capture_default_str()->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20))->excludes(input);
  sub->add_option("--batch", c.batch, "Synthetic: batch size")->capture_default_str()->check(CLI::Range(1, 64))->excludes(input);
  sub->add_option("--heads", c.heads, "Synthetic: query heads")->capture_default_str()->check(CLI::Range(1, 256))->excludes(input);
  sub->add_option("--kv-heads", c.kv_heads, "Synthetic: KV heads (divides --heads)")
      ->capture_default_str()->check(CLI::Range(1, 256))->excludes(input);
  sub->add_option("--needles", c.needles, "Synthetic: planted needles per (batch, KV head)")
      ->capture_default_str()->check(CLI::Range(0, 1024))->excludes(input);
  sub->add_option("--json", c.json, "Write every metric (overall and per head) as JSON to this file");
  return sub;
}

int run_eval(const EvalConfig& c) {
  if (c.input.empty() && !c.synthetic && c.save_synthetic.empty())
    throw std::runtime_error("eval needs an input: --input FILE, --synthetic or --save-synthetic FILE");
  if (c.heads % c.kv_heads != 0)
    throw std::runtime_error(fmt::format("--heads ({}) must be a multiple of --kv-heads ({})", c.heads, c.kv_heads));
  if (c.budgets.empty()) throw std::runtime_error("--budget needs at least one value");
  for (int b : c.budgets)
    if (b < 1) throw std::runtime_error(fmt::format("--budget must be >= 1, got {}", b));
  if (!c.save_synthetic.empty()) {
    save_synthetic(c);
    return 0;
  }
  const std::vector<Variant> variants = variants_for(c.selectors);
  if (!c.json.empty()) check_writable(c.json);
  const Placement where = Placement::choose("cpu");
  fmt::print("{}\n", where.banner());

  Inputs in;
  if (c.synthetic) {
    SyntheticConfig sc{c.seed, c.batch, c.len, c.heads, c.kv_heads, c.needles, 0};
    sc.needle_first_query = tail_start(c.len, c.eval_queries < 0 ? 512 : c.eval_queries);
    progress("building the synthetic workload (B={}, Hq={}, Hkv={}, L={}, seed {})", c.batch, c.heads, c.kv_heads, c.len, c.seed);
    SyntheticWorkload wl = make_synthetic_workload(sc);
    in.p = wl.p;
    in.q = std::move(wl.q);
    in.k = std::move(wl.k);
    in.v = std::move(wl.v);
    in.needles = std::move(wl.needles);
    in.source = fmt::format("synthetic (seed {}: {} attention sinks, local bands, planted needles)", c.seed, kSyntheticSinkKeys);
  } else {
    progress("reading {}", c.input);
    in = load_input(c.input, !c.non_causal);
  }
  const ProblemShape& p = in.p;
  const double scale = resolve_scale(kOp, c.softmax_scale, p.D);
  const auto iv = index_views(in);
  const std::int64_t start = tail_start(p.Lq, c.eval_queries < 0 ? (c.synthetic ? 512 : 0) : c.eval_queries);
  ProblemShape pt = p;  // the evaluated queries [start, Lq) against every key
  pt.Lq = p.Lq - start;
  const TensorView q_tail = drop_front(in.q.view(), 1, start);

  fmt::print("input: {}\n", in.source);
  fmt::print("problem: {}, {}, softmax scale {:.6g}\n", p.describe(), dtype_name(in.q.dtype()), scale);
  fmt::print("quality measured on queries {}..{} ({} of {}){}\n", start, p.Lq - 1, pt.Lq, p.Lq,
             start > 0 ? " (--eval-queries 0 for all)" : "");
  if (!in.needles.empty()) fmt::print("planted needles: {}\n", in.needles.size());
  fmt::print("token_max index vectors: {}\n", iv->token_max_note);
  fmt::print("lightning index: {}\n", iv->lightning_note);
  fmt::print("budgets (KV blocks per Q tile / per query; token selections keep 128x as many keys):");
  for (int b : c.budgets) fmt::print(" {}", b);
  fmt::print("\n");

  std::vector<OracleLists> oracle;
  double oracle_ms = NAN;
  if (std::any_of(variants.begin(), variants.end(), [](const Variant& v) { return is_oracle(v.kind); })) {
    progress("oracle: float64 dense attention over the evaluated queries, top blocks and keys by mass");
    std::vector<int> clamped;
    double list_bytes = 0.0;  // the token lists dominate: up to budget x 128 keys per query
    for (int b : c.budgets) {
      clamped.push_back(static_cast<int>(std::min<std::int64_t>(b, p.Tk())));
      list_bytes += 4.0 * double(pt.B * pt.Hkv) * double(pt.Lq) * double(std::min<std::int64_t>(b * kBlockK, p.Lk) + 2 * b);
    }
    check_memory(list_bytes, fmt::format("the oracle lists of --budget over {} evaluated queries (--eval-queries)", pt.Lq));
    oracle_ms = time_ms(false, [&] { oracle = oracle_select(q_tail, in.k.view(), pt, scale, clamped); });
  }

  QualityOptions qopt;
  qopt.causal = p.causal;
  qopt.softmax_scale = static_cast<float>(scale);
  std::vector<Row> rows;
  const std::size_t total = variants.size() * c.budgets.size();
  for (std::size_t bi = 0; bi < c.budgets.size(); ++bi) {
    // A budget past the number of blocks selects what a budget of Tk does; clamping keeps the
    // list buffers small for any --budget.
    const int kb = static_cast<int>(std::min<std::int64_t>(c.budgets[bi], p.Tk()));
    const std::int64_t kt = std::min<std::int64_t>(std::int64_t(kb) * kBlockK, p.Lk);
    for (const auto& v : variants) {
      progress("[{}/{}] {} {} budget {}", rows.size() + 1, total, v.name, v.format, c.budgets[bi]);
      Row row;
      row.variant = &v;
      row.budget = c.budgets[bi];
      row.keys_per_query = kt;
      std::vector<HostTensor> buffers;
      Selection full;  // over every query (selectors); the oracle is built over the tail only
      Selection tail;
      auto timed = [&](const std::function<void()>& f) { row.select_ms = time_ms(false, f); };
      switch (v.kind) {
        case Kind::pooled_r1:
        case Kind::pooled_r4: {
          buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Tq(), kb});
          buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Tq()});
          PooledOptions o;
          o.representatives = v.kind == Kind::pooled_r1 ? 1 : 4;
          o.top_k = kb;
          o.force_local = true;
          o.force_block0 = true;
          o.causal = p.causal;
          const TileLists t{buffers[0].view(), buffers[1].view()};
          timed([&] { pooled_select(in.q.view(), in.k.view(), t, o); });
          full = t;
          break;
        }
        case Kind::token_max_queries:
        case Kind::token_max_tiles: {
          TokenMaxOptions o;
          o.top_k = kb;
          o.precision = v.precision;
          o.causal = p.causal;
          o.reserve_local = true;
          if (v.kind == Kind::token_max_queries) {
            buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Lq, kb});
            const QueryLists ql{buffers[0].view()};
            timed([&] { token_max_select(iv->qidx, iv->kidx, ql, o); });
            full = ql;
          } else {
            buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Tq(), kb});
            buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Tq()});
            const TileLists t{buffers[0].view(), buffers[1].view()};
            timed([&] { token_max_select(iv->qidx, iv->kidx, t, o); });
            full = t;
          }
          break;
        }
        case Kind::lightning_tokens:
        case Kind::lightning_blocks: {
          LightningOptions o;
          o.causal = p.causal;
          o.precision = IndexPrecision::fp8_e4m3;
          if (v.kind == Kind::lightning_tokens) {
            o.top_k = static_cast<int>(kt);
            buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Lq, kt});
            const TokenLists tl{buffers[0].view()};
            timed([&] { lightning_select(iv->qI, iv->w, iv->kI, tl, o); });
            full = tl;
          } else {
            o.top_k = kb;
            buffers.emplace_back(DType::i32, std::vector<std::int64_t>{p.B, p.Hkv, p.Lq, kb});
            const QueryLists ql{buffers[0].view()};
            timed([&] { lightning_select(iv->qI, iv->w, iv->kI, ql, o); });
            full = ql;
          }
          break;
        }
        case Kind::oracle_tiles: tail = TileLists{oracle[bi].tile_idx.view(), oracle[bi].tile_cnt.view()}; break;
        case Kind::oracle_queries: tail = QueryLists{oracle[bi].query_idx.view()}; break;
        case Kind::oracle_tokens: tail = TokenLists{oracle[bi].token_idx.view()}; break;
      }
      if (!is_oracle(v.kind)) tail = drop_queries(full, start);
      row.quality = evaluate_selection(q_tail, in.k.view(), in.v.view(), tail, qopt);
      row.needles = needle_recall(tail, pt, in.needles, start);
      rows.push_back(std::move(row));
    }
  }

  // ---- the oracle bound: no selector keeps more mass than the oracle of its granularity
  std::vector<std::string> violations;
  bool bound_checked = false;
  for (const auto& o : rows) {
    if (!is_oracle(o.variant->kind)) continue;
    const int og = granularity(o.variant->format);
    for (const auto& r : rows) {
      if (is_oracle(r.variant->kind) || r.budget != o.budget || granularity(r.variant->format) > og) continue;
      bound_checked = true;
      if (r.quality.kept_mass_mean > o.quality.kept_mass_mean + 1e-9)
        violations.push_back(fmt::format("budget {}: {} {} keeps {:.9f} > oracle {} {:.9f}", r.budget, r.variant->name,
                                         r.variant->format, r.quality.kept_mass_mean, o.variant->format,
                                         o.quality.kept_mass_mean));
    }
  }

  // ---- report
  const bool any_needles = !in.needles.empty();
  fmt::print("\n{:<19} {:<10} {:>6} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10}\n", "selector", "selection", "budget",
             "keys", "mass mean", "mass min", "out err", "tok sp", "blk sp", "needles", "select ms");
  for (const auto& r : rows)
    fmt::print("{:<19} {:<10} {:>6} {:>6} {:>9} {:>9} {:>9.2e} {:>8} {:>8} {:>8} {:>10}\n", r.variant->name,
               r.variant->format, r.budget, r.keys_per_query, pct(r.quality.kept_mass_mean), pct(r.quality.kept_mass_min),
               r.quality.out_rel_err, pct(r.quality.token_sparsity), pct(r.quality.block_sparsity), pct(r.needles),
               std::isnan(r.select_ms) ? std::string("-") : fmt::format("{:.1f}", r.select_ms));
  fmt::print(
      "\nbudget: KV blocks per Q tile (TileLists) or per query (QueryLists); keys: the most keys a query may select "
      "(TokenLists: budget x 128). mass: fraction of each query's dense softmax mass on its selected keys (mean, worst "
      "query). out err: ||out - dense|| / ||dense|| of the renormalised sparse output (float64). tok sp / blk sp: "
      "visible (query, key) pairs / (Q tile, KV block) tiles left out. needles: {}. select ms: one CPU call of the "
      "selector (whole problem); the oracle is one shared float64 dense pass{}.\n",
      any_needles ? "planted needle keys selected by their queries (per head)" : "no planted needles in this input",
      std::isnan(oracle_ms) ? std::string() : fmt::format(" ({:.0f} ms for every budget)", oracle_ms));

  for (int table = 0; table < 2; ++table) {
    fmt::print("\nper head: {}\n{:<19} {:<10} {:>6}", table == 0 ? "kept mass mean" : "output relative error", "selector",
               "selection", "budget");
    for (std::int64_t h = 0; h < p.Hq; ++h) fmt::print(" {:>8}", fmt::format("h{}", h));
    fmt::print("\n");
    for (const auto& r : rows) {
      fmt::print("{:<19} {:<10} {:>6}", r.variant->name, r.variant->format, r.budget);
      for (std::int64_t h = 0; h < p.Hq; ++h) {
        const auto hs = static_cast<std::size_t>(h);
        fmt::print(" {:>8}", table == 0 ? pct(r.quality.kept_mass_mean_per_head[hs])
                                        : fmt::format("{:.2e}", r.quality.out_rel_err_per_head[hs]));
      }
      fmt::print("\n");
    }
  }

  if (!bound_checked)
    fmt::print("\noracle bound: not checked (select the oracle and another selector)\n");
  else if (violations.empty())
    fmt::print("\noracle bound holds: at every budget no selector keeps more mass than the oracle of its granularity "
               "(TileLists <= oracle TileLists <= oracle QueryLists <= oracle TokenLists)\n");
  else
    for (const auto& v : violations) fmt::print("\noracle bound VIOLATED: {}\n", v);

  if (!c.json.empty()) {
    nlohmann::json j = build_json(where);
    j["command"] = "eval";
    j["config"] = {{"source", in.source},
                   {"batch", p.B},
                   {"lq", p.Lq},
                   {"lk", p.Lk},
                   {"heads", p.Hq},
                   {"kv_heads", p.Hkv},
                   {"dim", p.D},
                   {"dtype", dtype_name(in.q.dtype())},
                   {"causal", p.causal},
                   {"softmax_scale", scale},
                   {"eval_first_query", start},
                   {"budgets", c.budgets},
                   {"selectors", c.selectors},
                   {"token_max_index", iv->token_max_note},
                   {"lightning_index", iv->lightning_note}};
    if (c.synthetic) {
      j["config"]["seed"] = c.seed;
      j["config"]["workload"] = "synthetic";
    }
    j["needles"] = nlohmann::json::array();
    for (const auto& nd : in.needles)
      j["needles"].push_back({{"b", nd.b}, {"group", nd.g}, {"q_tile", nd.tile}, {"kv_block", nd.block},
                              {"keys", {nd.key_begin, nd.key_end}}});
    j["results"] = nlohmann::json::array();
    for (const auto& r : rows) {
      const auto& q = r.quality;
      j["results"].push_back({{"selector", r.variant->name},
                              {"selection", r.variant->format},
                              {"oracle", is_oracle(r.variant->kind)},
                              {"budget", r.budget},
                              {"keys_per_query", r.keys_per_query},
                              {"kept_mass_mean", q.kept_mass_mean},
                              {"kept_mass_min", q.kept_mass_min},
                              {"out_rel_err", number_or_null(q.out_rel_err)},
                              {"token_sparsity", q.token_sparsity},
                              {"block_sparsity", q.block_sparsity},
                              {"selected_pairs", q.selected_pairs},
                              {"visible_pairs", q.visible_pairs},
                              {"needle_recall", number_or_null(r.needles)},
                              {"select_ms", number_or_null(r.select_ms)},
                              {"per_head",
                               {{"kept_mass_mean", q.kept_mass_mean_per_head},
                                {"kept_mass_min", q.kept_mass_min_per_head},
                                {"out_rel_err", q.out_rel_err_per_head}}}});
    }
    j["oracle_ms"] = number_or_null(oracle_ms);
    j["oracle_bound"] = {{"checked", bound_checked}, {"holds", violations.empty()}, {"violations", violations}};
    write_json(c.json, j);
    progress("wrote {}", c.json);
  }
  return violations.empty() ? 0 : 1;
}

}  // namespace sparse_attn::cli
