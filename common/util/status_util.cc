#include "common/util/status_util.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::util {

absl::Status FromErrno(int err, std::string_view context) {
  // Debian's abseil has its own string_view type, so convert explicitly.
  std::string msg = absl::StrCat(absl::string_view(context.data(), context.size()), ": ",
                                 std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case EINVAL:
      return absl::InvalidArgumentError(msg);
    case ENOSPC:
    case ENOMEM:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace tandem::util
