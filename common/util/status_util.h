// Conversions from foreign error spaces into absl::Status, one function per space.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace tandem::util {

// errno value -> Status with the given context ("open /path") and strerror text.
absl::Status FromErrno(int err, std::string_view context);

}  // namespace tandem::util

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define TANDEM_RETURN_IF_ERROR(expr)              \
  do {                                            \
    ::absl::Status _tandem_st = (expr);           \
    if (!_tandem_st.ok()) return _tandem_st;      \
  } while (0)

#define TANDEM_CONCAT_INNER(a, b) a##b
#define TANDEM_CONCAT(a, b) TANDEM_CONCAT_INNER(a, b)
// TANDEM_ASSIGN_OR_RETURN(auto x, StatusOrExpr);
#define TANDEM_ASSIGN_OR_RETURN(lhs, expr) \
  TANDEM_ASSIGN_OR_RETURN_IMPL(TANDEM_CONCAT(_tandem_sor_, __LINE__), lhs, expr)
#define TANDEM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
