#include "engine/runtime/step_plan.h"

#include <algorithm>

namespace tandem::engine {

void StepPlan::Build(std::span<const SeqChunk> chunks, int32_t bs, bool decode_kernel) {
  ints.clear();
  slots.clear();
  launches.clear();
  logit_rows.clear();
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) {
    for (size_t j = 0; j < ch.tokens.size(); ++j) {
      const int32_t pos = ch.start_pos + static_cast<int32_t>(j);
      ints.push_back(pos);
      slots.push_back(int64_t{ch.block_table[pos / bs]} * bs + pos % bs);
    }
    rows += static_cast<int64_t>(ch.tokens.size());
    if (ch.want_logits) {
      for (int64_t r = rows - ch.n_logits; r < rows; ++r) logit_rows.push_back(r);
    }
  }
  int64_t row = 0;
  for (size_t i = 0; i < chunks.size();) {
    const int64_t n = static_cast<int64_t>(chunks[i].tokens.size());
    AttentionLaunch a;
    a.row = row;
    if (n == 1 && decode_kernel) {
      size_t j = i;
      while (j < chunks.size() && chunks[j].tokens.size() == 1) {
        a.table_width = std::max(a.table_width, (chunks[j].start_pos + bs) / bs);
        a.max_len = std::max(a.max_len, chunks[j].start_pos + 1);
        ++j;
      }
      a.decode = true;
      a.n = static_cast<int32_t>(j - i);
      a.lens_off = static_cast<int64_t>(ints.size());
      for (size_t k = i; k < j; ++k) ints.push_back(chunks[k].start_pos + 1);
      a.table_off = static_cast<int64_t>(ints.size());
      for (size_t k = i; k < j; ++k) {
        const int32_t need = (chunks[k].start_pos + bs) / bs;
        ints.insert(ints.end(), chunks[k].block_table.begin(),
                    chunks[k].block_table.begin() + need);
        ints.insert(ints.end(), static_cast<size_t>(a.table_width - need), int32_t{0});
      }
      row += a.n;
      i = j;
    } else {
      const int32_t end = chunks[i].start_pos + static_cast<int32_t>(n);
      a.n = static_cast<int32_t>(n);
      a.max_pos = end - 1;
      a.table_off = static_cast<int64_t>(ints.size());
      ints.insert(ints.end(), chunks[i].block_table.begin(),
                  chunks[i].block_table.begin() + (end + bs - 1) / bs);
      row += n;
      ++i;
    }
    launches.push_back(a);
  }
}

}  // namespace tandem::engine
